"""Checkpoints that cross devices: the run both sides continue, and the CPU launches that make or resume one.

One training run (the toy model, bnb AdamW8bit, ZeRO-2, fp32, default settings) is saved by 2 CPU ranks after
SAVE_STEP steps. Its reference continuation is made on the CPU at DP 1 (the DP size the GPU runs), so that what
separates it from the GPU's continuation is the device alone: a continuation file holds the loss of each step and
every parameter's fp32 weights at the end, and another device or DP size that loads the tag is held to it.

    torchrun --nproc_per_node 2 tests/gpu/cross_device.py make --dir D          # tag "cpu" after SAVE_STEP steps
    torchrun --nproc_per_node 1 tests/gpu/cross_device.py resume --dir D --tag cpu --record D/continuation.pt
    torchrun --nproc_per_node 2 tests/gpu/cross_device.py resume --dir D --tag gpu --expect F --result R.json

The bars: losses within LOSS_TOLERANCE (the bar of the project's elastic tests), and weights within
WEIGHT_TOLERANCE. Weights get a bar of their own because a rounding difference anywhere (another device's matmuls,
another DP size's gradient sums) can move an 8-bit moment by one code, and one code of a moment moves Adam's update by
up to about 1% of lr: measured on the CPU, the same tag continued at DP 1 and DP 2 ends 1.2e-5 apart after 3 steps at
lr 1e-3 with losses 5e-7 apart. A load that lost the state moves weights by about lr per step (the control).
Across devices the losses get CROSS_DEVICE_LOSS_TOLERANCE: the weights may then differ by up to their bar, and the
losses follow the weights (measured: an H200 continuing the CPU's tag ended 1.7e-5 apart in loss and 2.9e-5 in the
weights after 3 steps, against 0.22 and 8.7e-3 for the control that loaded nothing).
Every launch ends with teardown.finish().
"""

import argparse
import json
import os

import proof_common as common  # noqa: F401  (puts tests/ on the path: support.toy)

SAVE_STEP = 3  # steps before the CPU checkpoint
CONTINUE_STEPS = 3  # steps each continuation takes
LR = 1e-3
LOSS_TOLERANCE = 1e-5
CROSS_DEVICE_LOSS_TOLERANCE = 1e-4  # still 2000x under the control's distance
WEIGHT_TOLERANCE = 0.02 * LR * CONTINUE_STEPS  # 2% of the distance Adam can move an element in the continuation
CPU_TAG, GPU_TAG = "cpu", "gpu"
CONTINUATION = "continuation.pt"  # the reference continuation of tag "cpu", in the save folder


def build(world: int, device: str):
    import bitsandbytes as bnb
    import deepspeed

    import deepspeed_bnb  # noqa: F401
    from support.toy import ds_config, make_model, param_groups
    model = make_model(0).to(device)
    optimizer = bnb.optim.AdamW8bit(param_groups(model, lr=LR))
    return deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config(world, stage=2))[0]


def train(engine, steps, device: str):
    """One global batch per step, this rank's share of it; returns the global loss of each step."""
    import torch.distributed as tdist

    from support.toy import global_batch, local_slice, loss_fn
    rank, world = tdist.get_rank(), tdist.get_world_size()
    losses = []
    for step in steps:
        tokens, targets = (local_slice(t, rank, world).to(device) for t in global_batch(step))
        loss = loss_fn(engine, tokens, targets)
        engine.backward(loss)
        engine.step()
        total = loss.detach().double().reshape(1)
        tdist.all_reduce(total)
        losses.append(float(total) / world)
    return losses


def full_weights(engine) -> dict:
    """name -> full fp32 weights on the CPU (DeepSpeed's own API; every rank takes part)."""
    from deepspeed.utils import safe_get_full_fp32_param
    return {name: safe_get_full_fp32_param(p).detach().float().cpu().clone()
            for name, p in engine.module.named_parameters()}


def compare(expected: dict, found: dict) -> dict:
    """How far continuation `found` is from `expected`: largest loss and weight differences, and the verdicts."""
    loss_diff = max(abs(a - b) for a, b in zip(found["losses"], expected["losses"]))
    weight_diff = max(float((found["weights"][n] - w).abs().max()) for n, w in expected["weights"].items())
    same_length = len(found["losses"]) == len(expected["losses"])
    devices = {expected.get("device"), found.get("device")}
    loss_bar = LOSS_TOLERANCE if len(devices) == 1 else CROSS_DEVICE_LOSS_TOLERANCE
    return {"loss_diff": loss_diff, "weight_diff": weight_diff, "steps": len(found["losses"]),
            "exact": same_length and loss_diff == 0 and weight_diff == 0,
            "within": same_length and loss_diff <= loss_bar and weight_diff <= WEIGHT_TOLERANCE, "loss_bar": loss_bar,
            "from": f"{expected.get('device')} at DP {expected.get('world')}",
            "to": f"{found.get('device')} at DP {found.get('world')}"}


def make(folder: str, device: str = "cpu") -> None:
    """Train SAVE_STEP steps and save tag CPU_TAG into `folder`."""
    import torch.distributed as tdist
    engine = build(tdist.get_world_size(), device)
    train(engine, range(SAVE_STEP), device)
    engine.save_checkpoint(folder, tag=CPU_TAG)


def continue_run(engine, device: str, steps: int = CONTINUE_STEPS, start=None) -> dict:
    """`steps` more steps of `engine` on the batches of steps `start`... (default: where it stands): the
    continuation (losses, weights, where it ran)."""
    import torch.distributed as tdist
    start = engine.global_steps if start is None else start
    losses = train(engine, range(start, start + steps), device)
    return {"from_step": start, "losses": losses, "weights": full_weights(engine), "device": device,
            "world": tdist.get_world_size()}


def loaded(folder: str, tag: str, device: str, at_step=None):
    """A new engine at this world size with `tag` of `folder` loaded (and at `at_step`, when given)."""
    import torch.distributed as tdist
    engine = build(tdist.get_world_size(), device)
    path, _ = engine.load_checkpoint(folder, tag=tag)
    if path is None:
        raise RuntimeError(f"load_checkpoint({folder!r}, tag={tag!r}) loaded nothing")
    if at_step is not None and engine.global_steps != at_step:
        raise RuntimeError(f"tag {tag} of {folder} is at step {engine.global_steps}; expected {at_step}")
    return engine


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=["make", "resume"])
    parser.add_argument("--dir", required=True)
    parser.add_argument("--tag", default=GPU_TAG)
    parser.add_argument("--record", help="resume: write the continuation here (rank 0)")
    parser.add_argument("--expect", help="resume: the continuation file to be held to")
    parser.add_argument("--result", help="resume with --expect: where rank 0 writes the comparison (JSON)")
    args = parser.parse_args()
    import deepspeed
    import torch
    import torch.distributed as tdist

    from deepspeed_bnb.utils import teardown
    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    if args.mode == "make":
        make(args.dir)
    else:
        expected = torch.load(args.expect, weights_only=True) if args.expect else None
        engine = loaded(args.dir, args.tag, "cpu", at_step=expected["from_step"] if expected else None)
        found = continue_run(engine, "cpu", len(expected["losses"]) if expected else CONTINUE_STEPS)
        if tdist.get_rank() == 0:
            if args.record:
                torch.save(found, args.record)
            if expected is not None:
                with open(args.result, "w") as f:
                    json.dump(compare(expected, found), f)
    teardown.finish()


if __name__ == "__main__":
    main()
