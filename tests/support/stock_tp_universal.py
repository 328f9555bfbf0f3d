"""A stock AutoTP run (torch AdamW, 2 tensor-parallel ranks, ZeRO-2, frozen parameters), converted by DeepSpeed's own
ds_to_universal, loaded by a deepspeed_bnb AutoTP engine of AdamW8bit: what each rank held before and after, for
tests/distributed/test_stock_tp_universal.py. Run by torchrun on 2 ranks: OUT is its folder."""

import os
import sys

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, TESTS)  # `import support` (support/__init__.py)

import bitsandbytes as bnb  # noqa: E402
import deepspeed  # noqa: E402
import torch  # noqa: E402
from deepspeed import comm as dist  # noqa: E402

import deepspeed_bnb  # noqa: E402,F401
from deepspeed_bnb.utils.teardown import finish  # noqa: E402
from support.parallel_scenarios import FROZEN, run_steps  # noqa: E402
from support.toy import VOCAB, ds_config, freeze  # noqa: E402

TP = 2


def build(seed: int, stock: bool):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32))
    trained = freeze(model, FROZEN[False])
    config = {**ds_config(1, stage=2), "tensor_parallel": {"autotp_size": TP}}
    if stock:
        optimizer = torch.optim.AdamW(trained, lr=1e-3)
    else:
        config["checkpoint"] = {"load_universal": True}
        optimizer = bnb.optim.AdamW8bit(trained, lr=1e-3, min_8bit_size=1000)
    return deepspeed.initialize(model=model, optimizer=optimizer, config=config)[0]


def main(out: str) -> None:
    from types import SimpleNamespace

    from deepspeed.checkpoint.ds_to_universal import main as ds_to_universal
    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    engine = build(seed=0, stock=True)
    run_steps(engine, range(2), pipeline=False)
    engine.save_checkpoint(os.path.join(out, "ckpt"), tag="t")
    saved = {name: p.detach().clone() for name, p in engine.module.named_parameters()}
    if rank == 0:  # DeepSpeed's converter (deepspeed_bnb hands stock checkpoints to it); strict stops on frozen ones
        ds_to_universal(SimpleNamespace(input_folder=os.path.join(out, "ckpt", "t"),
                                        output_folder=os.path.join(out, "ckpt", "t_universal"), num_extract_workers=1,
                                        num_merge_workers=1, keep_temp_folder=False, strict=False,
                                        inject_missing_state=False))
    dist.barrier()
    loader = build(seed=1, stock=False)
    before = {name: p.detach().clone() for name, p in loader.module.named_parameters()}
    loader.load_checkpoint(os.path.join(out, "ckpt"), tag="t_universal")
    torch.save({"saved": saved, "before": before,
                "loaded": {name: p.detach().clone() for name, p in loader.module.named_parameters()},
                "trained": [name for name, p in loader.module.named_parameters() if p.requires_grad]},
               os.path.join(out, f"rank{rank}.pt"))


if __name__ == "__main__":
    main(sys.argv[1])
    finish()
