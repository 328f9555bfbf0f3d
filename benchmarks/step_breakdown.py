"""`engine.step()` of the demo GPT taken apart: configurations stepped alternately in one process, each part timed.

Where `compare_adam.py` runs each configuration as a job of its own (so its peak memory is its own) and reads the
whole step, this builds the engines of several configurations in one job, steps them in turn on the same batches and
times `engine.step()` and the parts of it that differ between them, by wrapping these methods for the run:
  overflow      DeepSpeed's check for inf/NaN gradients (`check_overflow`: fp16, and bf16 where it is on)
  norm          DeepSpeed's gradient norm (`scaled_global_norm`: fp64 per-parameter norms and their all-reduce)
  unscale       DeepSpeed's unscale/clip (`unscale_and_clip_grads`; deepspeed_bnb's computes the factor only)
  optimizer     the partition steps (`_optimizer_step`, all param groups): torch's optimizer, or deepspeed_bnb's:
    route         which code steps each parameter, re-checked every step (`PartitionStep.route`)
    fused         the fused kernel's step of a partition (`FusedPartition.step`: hyper rows and the call)
    kernel          the compiled operator's call itself (`rules.step_`)
    bnb           bitsandbytes' own update of what the kernel does not step (`BnbAdapter.step`)
  flatten       the gradient partition's flatten (`flatten_dense_tensors`)
  weights       the parameters pointed at the updated flat buffers again (`_update_model_bit16_weights`; deepspeed_bnb's
                skips it where they already view them)
  all-gather    the updated partitions' all-gather (`all_gather_dp_groups`)
  other         the rest of `engine.step()`: the code between the parts above (DeepSpeed's and, where it overrides
                the step itself, deepspeed_bnb's)
With `--stage 3`, ZeRO-3's step method by method instead (STAGE3_PARTS: the parameters' partition, the inf/NaN check,
the norm, each sub-group's preparation, unscale/clip (deepspeed_bnb's computes the factor only, as at ZeRO-2),
optimizer step, weights written back and release, the step's epilogue), the optimizer's nested parts as above.
`--host-bound`: the GPU proof's 1B GPT's depth (20 layers: its 245 parameter tensors) at width 32, so that every
tensor is tiny and each part's time is the host's own work around its operators: on a GPU the device runs the
operators asynchronously, and where it waits for the host (part s of the GPU proof saw it idle most of a 1B step),
that work is the step's time.
Per configuration the median over the timed steps of each part's time per step, in ms, and the step's ratio to the
last configuration's. Same model (but for `--host-bound`), data, schedule and hyper-parameters as compare_adam.py
(compare_adam_worker.py).

    python benchmarks/step_breakdown.py                      # 1 rank, bnb8_fused vs torch_adamw_fused, 120 steps
    python benchmarks/step_breakdown.py --nproc 2 --steps 200
    python benchmarks/step_breakdown.py --configs bnb8_fused bnb8_fallback torch_adamw_fused
    python benchmarks/step_breakdown.py --bf16 --nproc 2 --configs bnb8_fused bnb8_master_bf16 torch_adamw_fused
    python benchmarks/step_breakdown.py --stage 3 --bf16
    python benchmarks/step_breakdown.py --stage 3 --bf16 --host-bound --steps 200
"""

import argparse
import collections
import functools
import json
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from compare_adam_configs import BF16_ONLY, CONFIGS, LABELS  # noqa: E402

PARTS = ("overflow", "norm", "unscale", "optimizer", "route", "fused", "kernel", "bnb", "flatten", "weights",
         "all-gather")
TOP_LEVEL = ("overflow", "norm", "unscale", "optimizer", "flatten", "weights", "all-gather")  # none nested in another
NESTED = ("route", "fused", "kernel", "bnb")  # inside `optimizer`
# ZeRO-3's step (DeepSpeedZeroOptimizer_Stage3.step, DeepSpeed 0.19.8), method by method: (method, label)
STAGE3_PARTS = (("_partition_all_parameters", "partition"), ("_overflow_check_and_loss_scale_update", "overflow"),
                ("_get_norm_groups", "norm"), ("_prepare_sub_group", "prepare"), ("unscale_and_clip_grads", "unscale"),
                ("_optimizer_step", "optimizer"), ("_reassign_or_swap_out_partitioned_parameters", "weights"),
                ("_release_sub_group", "release"), ("_post_step", "post"))
STAGE3_TOP_LEVEL = tuple(label for _, label in STAGE3_PARTS)
DEMO = dict(width=128, depth=4, heads=4)  # compare_adam.py's demo GPT
HOST_BOUND = dict(width=32, depth=20, heads=2)  # tests/gpu/part_speed.py's 1B GPT's layers, each tensor tiny


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=["bnb8_fused", "torch_adamw_fused"],
                   help=f"the last one is the ratios' reference ({', '.join(BF16_ONLY)}: with --bf16 only)")
    p.add_argument("--bf16", action="store_true", help="a bf16 model (DeepSpeed's bf16 section), as compare_adam.py's")
    p.add_argument("--nproc", type=int, default=1, help="data-parallel CPU ranks (one job)")
    p.add_argument("--stage", type=int, choices=(2, 3), default=2,
                   help="ZeRO stage (3: ZeRO-3's own parts of its step, STAGE3_PARTS)")
    p.add_argument("--host-bound", action="store_true",
                   help="the 1B GPT's 20 layers at width 32: the host's work per part, without the arithmetic's")
    p.add_argument("--steps", type=int, default=120, help="steps per configuration; the first 10 are not timed")
    p.add_argument("--worker", metavar="RESULT", help=argparse.SUPPRESS)  # a rank of the job: write RESULT (JSON)
    args = p.parse_args()
    if not args.bf16 and set(args.configs) & set(BF16_ONLY):
        p.error(f"{', '.join(sorted(set(args.configs) & set(BF16_ONLY)))}: bf16 master weights, for --bf16 only")
    return args


class Timer:
    """Accumulates the time spent in wrapped callables, per label, until reset(). With `sync` (a GPU's
    synchronize), each wrapped call starts and ends with it, so that a part's time holds the device work it queued."""

    def __init__(self, sync=None):
        self.spent = collections.defaultdict(float)
        self.sync = sync or (lambda: None)
        self.running = set()  # labels being timed now: an override calling the method it overrides counts once

    def wrap(self, owner, name: str, label: str) -> None:
        real = getattr(owner, name)

        @functools.wraps(real)
        def timed(*args, **kwargs):
            if label in self.running:
                return real(*args, **kwargs)
            self.running.add(label)
            self.sync()
            started = time.perf_counter()
            try:
                return real(*args, **kwargs)
            finally:
                self.sync()
                self.spent[label] += time.perf_counter() - started
                self.running.discard(label)
        setattr(owner, name, timed)

    def reset(self) -> dict:
        spent, self.spent = dict(self.spent), collections.defaultdict(float)
        return spent


def instrument(timer: Timer, parts=PARTS) -> None:
    """Wrap the methods behind each of `parts` (PARTS' labels) for the rest of the process."""
    import torch
    from deepspeed.runtime.zero import stage_1_and_2 as zero

    from deepspeed_bnb.ops import rules
    from deepspeed_bnb.optim.bnb_adapter import BnbAdapter
    from deepspeed_bnb.optim.fused.partition import FusedPartition
    from deepspeed_bnb.optim.fused.partition_step import PartitionStep
    from deepspeed_bnb.runtime.zero.stage_1_and_2 import BnbZeroOptimizer
    wrapped = []
    for owner in (zero.DeepSpeedZeroOptimizer, BnbZeroOptimizer):  # ours overrides both: each class's own method
        wrapped += [(owner, "unscale_and_clip_grads", "unscale"), (owner, "_optimizer_step", "optimizer"),
                    (owner, "_update_model_bit16_weights", "weights")]
    wrapped += [(zero.DeepSpeedZeroOptimizer, "check_overflow", "overflow"),
                (zero.DeepSpeedZeroOptimizer, "scaled_global_norm", "norm"),
                (zero, "all_gather_dp_groups", "all-gather"), (torch._C._nn, "flatten_dense_tensors", "flatten"),
                (PartitionStep, "route", "route"), (FusedPartition, "step", "fused"), (rules, "step_", "kernel"),
                (BnbAdapter, "step", "bnb")]
    for owner, name, label in wrapped:
        if label in parts:
            timer.wrap(owner, name, label)


def instrument_stage3(timer: Timer, nested=NESTED) -> None:
    """Wrap the methods behind the parts of ZeRO-3's `step()` (STAGE3_PARTS; each class's own where deepspeed_bnb's
    overrides one) and the optimizer's `nested` parts, for the rest of the process."""
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

    from deepspeed_bnb.runtime.zero.stage3 import BnbZeroStage3Optimizer
    for name in ("_optimizer_step", "unscale_and_clip_grads"):  # neither calls DeepSpeed's
        timer.wrap(BnbZeroStage3Optimizer, name, dict(STAGE3_PARTS)[name])
    for name, label in STAGE3_PARTS:
        timer.wrap(DeepSpeedZeroOptimizer_Stage3, name, label)
    instrument(timer, nested)


def worker(args) -> None:
    import deepspeed
    import torch

    import deepspeed_bnb  # noqa: F401
    import compare_adam_worker
    from deepspeed_bnb.demo.gpt import GPT, GPTConfig, decay_groups
    from deepspeed_bnb.demo.text import ByteBatches, stdlib_bytes
    from deepspeed_bnb.utils.teardown import finish
    timer = Timer()
    top_level = STAGE3_TOP_LEVEL if args.stage == 3 else TOP_LEVEL
    if args.stage == 3:
        instrument_stage3(timer)
    else:
        instrument(timer)
    engines = {}
    for config in args.configs:  # compare_adam_worker's settings for this configuration
        settings = argparse.Namespace(config=config, batch=16, stage=args.stage, bf16=int(args.bf16), offload=0,
                                      lr=3e-3, warmup_lr_steps=30)
        torch.manual_seed(0)
        model = GPT(GPTConfig(context=128, **(HOST_BOUND if args.host_bound else DEMO)))
        groups = decay_groups(model, 0.1)
        engines[config], *_ = deepspeed.initialize(
            model=model, optimizer=compare_adam_worker.client_optimizer(settings, groups), model_parameters=groups,
            config=compare_adam_worker.ds_config(settings))
    batches, generator = ByteBatches(stdlib_bytes(), 128), torch.Generator().manual_seed(0)
    times = {c: collections.defaultdict(list) for c in engines}
    for step in range(args.steps):
        tokens, targets = batches.sample("train", 16, generator)
        for config, engine in engines.items():
            engine.backward(engine(tokens, targets))
            timer.reset()
            started = time.perf_counter()
            engine.step()
            total = time.perf_counter() - started
            if step >= 10:
                spent = timer.reset()
                times[config]["engine.step()"].append(total)
                times[config]["other"].append(total - sum(spent.get(label, 0.0) for label in top_level))
                for label, part in spent.items():
                    times[config][label].append(part)
    if deepspeed.comm.get_rank() == 0:
        with open(args.worker, "w") as f:
            json.dump({c: {k: statistics.median(v) for k, v in parts.items()} for c, parts in times.items()}, f)
    finish()


def main() -> None:
    args = parse_args()
    if args.worker:
        worker(args)
        return
    from launch import torchrun
    with tempfile.TemporaryDirectory() as folder:
        result = os.path.join(folder, "step_breakdown.json")
        worker_args = ["--configs", *args.configs, "--steps", args.steps, "--stage", args.stage, "--worker", result]
        worker_args += ["--bf16"] * args.bf16 + ["--host-bound"] * args.host_bound
        wall = torchrun(os.path.abspath(__file__), args.nproc, worker_args)
        with open(result) as f:
            medians = json.load(f)
    reference = medians[args.configs[-1]]["engine.step()"]
    order = ((STAGE3_TOP_LEVEL + NESTED) if args.stage == 3 else PARTS) + ("other",)
    shown = [p for p in order if any(p in medians[c] for c in args.configs)]
    model = "the 1B GPT's 20 layers at width 32" if args.host_bound else "demo GPT"
    print(f"`python benchmarks/step_breakdown.py {' '.join(sys.argv[1:])}`: {model}{' (bf16)' if args.bf16 else ''}, "
          f"ZeRO-{args.stage}, {args.nproc} CPU "
          f"rank(s), {args.steps - 10} timed steps per configuration, stepped in turn ({wall:.0f} s). Medians per step "
          f"in ms, rank 0; a part nested in `optimizer` (route, fused, kernel, bnb) is counted in it as well.\n")
    print("| configuration | engine.step() | vs last | " + " | ".join(shown) + " |")
    print("|---|---:|---:|" + "---:|" * len(shown))
    for config in args.configs:
        parts = medians[config]
        cells = [f"{parts[p] * 1e3:.3f}" if p in parts else "-" for p in shown]
        print(f"| {LABELS[config]} | {parts['engine.step()'] * 1e3:.3f} | "
              f"{parts['engine.step()'] / reference:.2f}x | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
