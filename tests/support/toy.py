"""Tiny but awkward model, data and engine builder (and an engine's weights) shared by the single- and multi-rank tests.

Awkward on purpose: odd sizes, two param groups with different lr / weight decay, 8-bit and fp32 state side by side
(min_8bit_size=1000), a parameter smaller than one 256-block (head.bias: 97), and one larger than a whole ZeRO
partition at DP=3 (fc1.weight: 12040 elements of a ~31k-element group).
"""

import copy
import math
import zlib
from contextlib import nullcontext

import torch
from torch import nn

VOCAB, SEQ, GLOBAL_BATCH = 97, 8, 12  # GLOBAL_BATCH divides by 1, 2, 3, 4 and by 2 micro-steps at DP 1..3
MIN_8BIT_SIZE = 1000
NUM_EXPERTS = 4  # AwkwardMoE


class Awkward(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 40)
        self.fc1 = nn.Linear(40, 301)
        self.ln = nn.LayerNorm(301)
        self.fc2 = nn.Linear(301, 37)
        self.head = nn.Linear(37, VOCAB)

    def forward(self, tokens):
        h = self.emb(tokens)
        h = self.ln(torch.nn.functional.gelu(self.fc1(h)))
        return self.head(torch.tanh(self.fc2(h)))


class AwkwardMoE(Awkward):
    """Awkward with a DeepSpeed MoE layer after the embedding: NUM_EXPERTS experts spread over `ep_size` ranks, top-1
    gating without token dropping or random token selection, so a step is the same math at every DP and EP size."""

    def __init__(self, ep_size: int):
        from deepspeed.moe.layer import MoE
        super().__init__()
        expert = nn.Sequential(nn.Linear(40, 32), nn.GELU(), nn.Linear(32, 40))
        self.moe = MoE(hidden_size=40, expert=expert, num_experts=NUM_EXPERTS, ep_size=ep_size, k=1, min_capacity=0,
                       use_rts=False, drop_tokens=False)

    def forward(self, tokens):
        h = self.emb(tokens)
        h = h + self.moe(h)[0]
        h = self.ln(torch.nn.functional.gelu(self.fc1(h)))
        return self.head(torch.tanh(self.fc2(h)))


def make_model(seed=0, dtype=torch.float32, ep_size=None) -> Awkward:
    """The toy model (with ep_size: AwkwardMoE, its experts spread over that many ranks)."""
    torch.manual_seed(seed)
    return (Awkward() if ep_size is None else AwkwardMoE(ep_size)).to(dtype)


def param_groups(model, lr=1e-3):
    decay = [p for n, p in model.named_parameters() if n.endswith("weight") and not n.startswith("ln")]
    no_decay = [p for n, p in model.named_parameters() if not (n.endswith("weight") and not n.startswith("ln"))]
    return [{"params": decay, "weight_decay": 0.1, "lr": lr}, {"params": no_decay, "weight_decay": 0.0, "lr": lr / 2}]


def freeze(model, frozen, groups=None) -> list:
    """Freeze the parameters of `model` that `frozen` names (requires_grad False: the optimizer holds no state for
    them, as in a fine-tuning run); returns `groups` (param-group dicts) without them, or, where None, the parameters
    still trained."""
    for name, param in model.named_parameters():
        param.requires_grad_(name not in frozen)
    if groups is None:
        return [param for param in model.parameters() if param.requires_grad]
    return [{**group, "params": [p for p in group["params"] if p.requires_grad]} for group in groups]


def global_batch(step: int):
    """The same global batch for every DP size: (tokens, targets) of GLOBAL_BATCH sequences."""
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=g)
    return tokens, (tokens * 7 + 3) % VOCAB


def local_slice(tensor, rank: int, world: int, micro: int = 0, micro_steps: int = 1):
    """This rank's share of a global batch, and of it the given micro-step's share."""
    per_rank = tensor.shape[0] // world
    mine = tensor[rank * per_rank:(rank + 1) * per_rank]
    per_micro = per_rank // micro_steps
    return mine[micro * per_micro:(micro + 1) * per_micro]


def loss_fn(model_or_engine, tokens, targets):
    logits = model_or_engine(tokens)
    return nn.functional.cross_entropy(logits.float().reshape(-1, VOCAB), targets.reshape(-1))


def ds_config(world: int, stage=2, micro_steps=1, bf16=False, clip=0.0, offload=False, elastic=False, bf16_master=False,
              **zero):
    config = {
        "train_micro_batch_size_per_gpu": GLOBAL_BATCH // world // micro_steps,
        "gradient_accumulation_steps": micro_steps,
        "gradient_clipping": clip,
        "zero_optimization": {"stage": stage, "elastic_checkpoint": elastic, **zero},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if stage == 3:
        # DeepSpeed's memory-efficient linear replaces torch.nn.functional.linear process-wide and never puts it back,
        # which changes the rounding of every later model in the process (the tests build many): off in tests
        config["zero_optimization"].setdefault("memory_efficient_linear", False)
    if bf16:
        config["bf16"] = {"enabled": True}
        if bf16_master:  # DeepSpeed's own key for bf16 master weights (and gradients)
            config["bf16"]["bf16_master_weights_and_grads"] = True
    if offload:
        config["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
        config["zero_force_ds_cpu_optimizer"] = False
    return config


def clone(model):
    return copy.deepcopy(model)


def build_engine(optimizer_cls=None, seed=0, lr=1e-3, stock=False, zero=None, stage=2, emb32=False, checkpoint=None,
                 **optimizer_kwargs):
    """A one-rank ZeRO engine (stage 2 unless said) of the toy model (deepspeed_bnb's, or stock's with stock=True).
    emb32: the embedding in 32-bit state by a bnb GlobalOptimManager override, as HF Trainer registers one for its
    8-bit optimizers (resolved when deepspeed_bnb's engine is built, then cleared; not for a stock one, whose bnb
    resolves overrides at its first step). checkpoint: the config's "checkpoint" section."""
    import bitsandbytes as bnb
    import deepspeed
    from deepspeed_bnb.runtime.engine import stock_deepspeed
    assert not (emb32 and stock), "a stock engine resolves bnb overrides at its first step, after they are cleared"
    model = make_model(seed)
    manager = bnb.optim.GlobalOptimManager.get_instance()
    if emb32:
        manager.initialize()
        manager.register_module_override(model.emb, "weight", {"optim_bits": 32})
    optimizer = (optimizer_cls or bnb.optim.AdamW8bit)(param_groups(model, lr=lr), **optimizer_kwargs)
    config = ds_config(1, stage=stage, **(zero or {}))
    if checkpoint is not None:
        config["checkpoint"] = checkpoint
    try:
        if not stock:
            return deepspeed.initialize(model=model, optimizer=optimizer, config=config)[0]
        config["zero_allow_untested_optimizer"] = True  # stock DeepSpeed does not list bnb optimizers
        with stock_deepspeed():
            return deepspeed.initialize(model=model, optimizer=optimizer, config=config)[0]
    finally:
        if emb32:
            manager.initialize()


def gathered_weights(engine):
    """name -> full weight of an engine's module (gathered at stage 3)."""
    import deepspeed
    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params) if engine.zero_optimization_stage() == 3 else nullcontext():
        return {n: p.detach().clone() for n, p in engine.module.named_parameters()}


def train_steps(engine, steps):
    """One global batch per step on one rank; returns the losses."""
    losses = []
    for step in steps:
        tokens, targets = global_batch(step)
        loss = loss_fn(engine, tokens, targets)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def train_plain(model, optimizer, steps=range(3)):
    """The reference: plain training of `model` with `optimizer` (no DeepSpeed), one global batch per step."""
    for step in steps:
        tokens, targets = global_batch(step)
        loss_fn(model, tokens, targets).backward()
        optimizer.step()
        optimizer.zero_grad()


def moment_values(label: str, shape, positive: bool = False) -> torch.Tensor:
    """Deterministic optimizer-state values to set (the same at every DP size): each 256-element block of the
    flattened tensor gets its own scale between 1e-7 and 1e-1, and the second block, where there is one, is all zero."""
    g = torch.Generator().manual_seed(zlib.crc32(label.encode()))
    shape = tuple(shape)
    n = math.prod(shape)
    blocks = -(-n // 256)
    scale = (10.0 ** (-7 + 6 * torch.rand(blocks, generator=g))).repeat_interleave(256)[:n]
    values = torch.randn(n, generator=g) * scale
    values[256:512] = 0.0
    return (values.abs() if positive else values).reshape(shape)
