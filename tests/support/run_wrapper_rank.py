"""One rank of the `deepspeed-bnb run` checks (tests/support/run_wrapper_checks.py): a training script that never
imports deepspeed_bnb. It builds a ZeRO-2 engine for bnb's AdamW8bit and one for torch's AdamW, takes a step with
each, and writes which ZeRO optimizer DeepSpeed built for each to OUT/rank<r>.json.

    torchrun --nproc_per_node 2 tests/support/run_wrapper_rank.py OUT
"""

import json
import os
import sys

import bitsandbytes as bnb
import deepspeed
import torch

IMPORTED_BEFORE_DEEPSPEED_INIT = "deepspeed_bnb" in sys.modules  # set by the wrapper's hook at `import deepspeed`


def engine_for(make_optimizer, world):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8))
    # zero_allow_untested_optimizer: stock DeepSpeed refuses a bnb optimizer under ZeRO without it (HF's Trainer and
    # Accelerate set it for any client optimizer); deepspeed_bnb does not need it
    config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2}, "steps_per_print": 10**9,
              "zero_allow_untested_optimizer": True}
    engine = deepspeed.initialize(model=model, optimizer=make_optimizer(model.parameters()), config=config)[0]
    loss = engine(torch.randn(2, 64)).square().mean()
    engine.backward(loss)
    engine.step()
    return engine


def main():
    out = [arg for arg in sys.argv[1:] if not arg.startswith("--local_rank")][0]  # the deepspeed launcher adds it
    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = deepspeed.comm.get_rank(), deepspeed.comm.get_world_size()
    eight_bit = engine_for(lambda params: bnb.optim.AdamW8bit(params, lr=1e-3, min_8bit_size=100), world)
    state = next(iter(eight_bit.optimizer.optimizer.state.values()), {})
    plain = engine_for(lambda params: torch.optim.AdamW(params, lr=1e-3), world)
    result = {"rank": rank, "world": world, "bnb_engine": type(eight_bit.optimizer).__name__,
              "state1_dtype": str(state.get("state1").dtype) if torch.is_tensor(state.get("state1")) else None,
              "torch_engine": type(plain.optimizer).__name__, "deepspeed_bnb_loaded": "deepspeed_bnb" in sys.modules,
              "deepspeed_bnb_with_deepspeed": IMPORTED_BEFORE_DEEPSPEED_INIT}
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    from deepspeed_bnb.utils.teardown import finish  # (imports deepspeed_bnb: only once the result is written)
    finish()


if __name__ == "__main__":
    main()
