"""`engine.step()` with the model's copy of the updated weights written by the fused CPU kernel, against DeepSpeed's own
conversion pass after the optimizer, side by side in one engine.

One rank, the demo GPT in bf16 under ZeRO-2 and ZeRO-3 with bnb AdamW8bit on the CPU (the optimizer offloaded, or
not), stepping
alternately with DEEPSPEED_BNB_KERNEL_LP_COPY=1 (the kernel writes the copy: runtime/zero/lp_copy.py) and =0
(DeepSpeed's `copy_` of each fp32 partition), which the step reads at every call, so that both share the engine, the
batches and the machine's slow spells. Prints a markdown table: the median `engine.step()` of each and their ratio.
The trained weights are the same bits either way (tests/unit/test_model_copy_engine.py).

    python benchmarks/model_copy_step.py              # width 768 (29M parameters), ZeRO-2 and 3, offloaded and not
    python benchmarks/model_copy_step.py --width 256 --steps 40 --stages 2
"""

import argparse
import os
import statistics
import sys
import time
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

WARMUP = 6  # steps before the timed ones (the first after build is DeepSpeed's whole copy in both settings)


def engine_of(width: int, offload: bool, stage: int):
    import bitsandbytes as bnb
    import deepspeed

    import deepspeed_bnb  # noqa: F401  (routes the bnb optimizer to deepspeed_bnb's ZeRO optimizer)
    from deepspeed_bnb.demo.gpt import GPT, GPTConfig, decay_groups
    torch.manual_seed(0)
    model = GPT(GPTConfig(context=128, width=width, depth=4, heads=max(1, width // 32)))
    numel = sum(p.numel() for p in model.parameters())  # before ZeRO-3 partitions them
    groups = decay_groups(model, 0.1)
    config = {"train_micro_batch_size_per_gpu": 16, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
              "zero_optimization": {"stage": stage}, "bf16": {"enabled": True}, "steps_per_print": 10 ** 9}
    if offload:
        config["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
        config["zero_force_ds_cpu_optimizer"] = False
    engine = deepspeed.initialize(model=model, optimizer=bnb.optim.AdamW8bit(groups, lr=1e-3),
                                  model_parameters=groups, config=config)[0]
    return engine, numel


def timed_steps(engine, steps: int) -> dict:
    """setting -> engine.step() seconds, the settings alternating step by step."""
    from deepspeed_bnb.runtime.zero import lp_copy
    tokens = torch.randint(0, 256, (16, 129), generator=torch.Generator().manual_seed(0))
    times = {"1": [], "0": []}
    for step in range(WARMUP + 2 * steps):
        setting = "1" if step % 2 else "0"
        os.environ[lp_copy.ENV] = setting
        engine.backward(engine(tokens[:, :-1], tokens[:, 1:]))
        started = time.perf_counter()
        engine.step()
        if step >= WARMUP:
            times[setting].append(time.perf_counter() - started)
    return times


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=768, help="the GPT's width (depth 4, context 128)")
    parser.add_argument("--steps", type=int, default=25, help="timed steps per setting")
    parser.add_argument("--stages", type=int, nargs="+", choices=(2, 3), default=[2, 3], help="ZeRO stages")
    parser.add_argument("--port", default="29631")
    args = parser.parse_args()
    # torch's notice that ZeRO-3's reduce_scatter_tensor is deprecated, at every step
    warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")
    import deepspeed
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=args.port)
    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} CPUs\n")
    print("| bf16, one rank | parameters | engine.step(), kernel's copy | engine.step(), DeepSpeed's copy | ratio |")
    print("|---|---:|---:|---:|---:|")
    for stage in args.stages:
        for offload in (True, False):
            engine, numel = engine_of(args.width, offload, stage)
            times = timed_steps(engine, args.steps)
            ours, theirs = (statistics.median(times[s]) for s in ("1", "0"))
            label = f"ZeRO-{stage}, " + ("optimizer offloaded to the CPU" if offload else "on the CPU")
            print(f"| {label} | {numel / 1e6:.1f}M | {ours * 1e3:.2f} ms | {theirs * 1e3:.2f} ms | "
                  f"{ours / theirs:.3f}x |", flush=True)
            engine.destroy()


if __name__ == "__main__":
    main()
