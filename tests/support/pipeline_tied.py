"""A pipeline of 2 stages whose modules are tied across the stages (TiedLayerSpec): a trained embedding that the last
stage uses as its head, and a module frozen whole that each stage runs once. Saved after 3 steps, exported as an 8-bit
universal checkpoint, loaded by a 2-stage engine of another seed: what each rank held, for
tests/distributed/test_pipeline_tied.py. Run by torchrun on 2 ranks (OUT: its folder); `build` also makes the test's
one-stage loader."""

import json
import os
import sys

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, TESTS)  # `import support` (support/__init__.py)

import bitsandbytes as bnb  # noqa: E402
import deepspeed  # noqa: E402
import torch  # noqa: E402
from deepspeed import comm as dist  # noqa: E402
from torch import nn  # noqa: E402

import deepspeed_bnb  # noqa: E402,F401
from deepspeed_bnb.utils.teardown import finish  # noqa: E402
from support.parallel_scenarios import Block, Embed, pipeline_loss  # noqa: E402
from support.toy import GLOBAL_BATCH, MIN_8BIT_SIZE, ds_config, global_batch  # noqa: E402

MICRO = 2
FROZEN = "tied_modules.mix."  # the module frozen whole (no optimizer state names it)
SAVED_STEPS, CONTINUED_STEPS = range(3), range(3, 8)


class Mix(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(40, 40)

    def forward(self, h):
        return h + torch.tanh(self.lin(h))


def tied_head(module, h):
    return h @ module.emb.weight.t()


def build(seed: int, stages: int, universal: bool = False):
    from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
    torch.manual_seed(seed)
    # DeepSpeed broadcasts a tied module's `tied_weight_attr` tensors from its first stage at initialize (and
    # all-reduces their gradients): name every tensor of the module, or the stages start from different values
    embed, mix = dict(tied_weight_attr=["emb.weight"]), dict(tied_weight_attr=["lin.weight", "lin.bias"])
    model = PipelineModule([TiedLayerSpec("embed", Embed, **embed), TiedLayerSpec("mix", Mix, **mix),
                            LayerSpec(Block, 64), TiedLayerSpec("mix", Mix, **mix),
                            TiedLayerSpec("embed", Embed, forward_fn=tied_head, **embed)],
                           num_stages=stages, loss_fn=pipeline_loss, partition_method="uniform")
    return engine_of(model, (FROZEN,), dist.get_world_size() // stages, lr=1e-2, universal=universal)


def engine_of(model, frozen: tuple, dp: int, lr: float, universal: bool = False):
    """A ZeRO-1 engine of the PipelineModule `model` (MICRO micro-batches) whose parameters under the name prefixes
    `frozen` do not train; AdamW8bit steps the rest. `universal`: its load_checkpoint reads universal checkpoints."""
    for name, param in model.named_parameters():
        param.requires_grad_(not name.startswith(frozen))
    config = ds_config(dp, stage=1, micro_steps=MICRO)
    if universal:
        config["checkpoint"] = {"load_universal": True}
    optimizer = bnb.optim.AdamW8bit([p for p in model.parameters() if p.requires_grad], lr=lr,
                                    min_8bit_size=MIN_8BIT_SIZE)
    return deepspeed.initialize(model=model, optimizer=optimizer, config=config)[0]


def train(engine, steps):
    """The toy's global batches (one data-parallel rank), the loss of each step."""
    losses = []
    for step in steps:
        tokens, targets = global_batch(step)
        micro = GLOBAL_BATCH // MICRO
        losses.append(float(engine.train_batch(data_iter=iter(
            [(tokens[i * micro:(i + 1) * micro], targets[i * micro:(i + 1) * micro]) for i in range(MICRO)]))))
    return losses


def state(engine) -> dict:
    return {name: tensor.detach().clone() for name, tensor in engine.module.state_dict().items()}


def main(out: str) -> None:
    from deepspeed_bnb.cli import main as cli
    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    engine = build(seed=0, stages=2)
    train(engine, SAVED_STEPS)
    engine.save_checkpoint(os.path.join(out, "ckpt"), tag="t")
    saved = state(engine)
    continued = train(engine, CONTINUED_STEPS)
    if rank == 0:
        assert cli(["export", os.path.join(out, "ckpt"), os.path.join(out, "universal"), "--universal"]) == 0
    dist.barrier()
    loader = build(seed=1, stages=2, universal=True)
    before = state(loader)
    loader.load_checkpoint(os.path.join(out, "universal"))
    loaded = state(loader)
    resumed = train(loader, CONTINUED_STEPS)
    torch.save({"saved": saved, "before": before, "loaded": loaded}, os.path.join(out, f"rank{rank}.pt"))
    if rank == 0:
        with open(os.path.join(out, "losses.json"), "w") as f:
            json.dump({"continued": continued, "resumed": resumed}, f)


if __name__ == "__main__":
    main(sys.argv[1])
    finish()
