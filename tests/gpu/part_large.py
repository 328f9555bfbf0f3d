"""GPU proof, part e: one parameter of more than 2^31 elements (2^31 + 4096 fp32, about 9 GB, 40 GB with ZeRO-2's
buffers at DP 1) steps correctly, under bnb's own update (the default on a GPU) and under the fused kernel.

Why: bitsandbytes' CUDA update passes the element count as `ctypes.c_int32(numel)`, so a ZeRO partition that large
reaches its kernel with a negative count; deepspeed_bnb calls bnb's update on block-aligned pieces of at most
bnb_update.MAX_UPDATE_NUMEL (2^30) elements, and the fused kernel indexes in 64 bits. Reference, per window of the
parameter (the start, each piece boundary, the 2^31 boundary, the end): plain bnb AdamW8bit on that window alone on
the device (a block-wise update makes a window's result independent of the rest), for bnb's path and for the fused
kernel on a GPU (it computes bnb's own CUDA arithmetic); on the CPU rehearsal the fused kernel's pure-torch
reference; weights and 8-bit state bit for bit after each step.
Control: every window moved. On the CPU rehearsal the sizes are stand-ins (MAX_UPDATE_NUMEL 2^14, the parameter
2 * 2^14 + 4096 elements, ZeRO's buckets 2^13 elements): the same pieces, windows and ZeRO path for a parameter larger
than a bucket, small. Each path runs in a process of its own (about 40 GB each on the GPU).
"""

import json
import os
import subprocess
import sys

import proof_common as common

WINDOW = 4096  # elements each side of a boundary (8-bit state: bnb's min_8bit_size is 4096)
STEPS = 2
LR = 1e-3
GPU_LIMIT = 1 << 30  # bnb_update.MAX_UPDATE_NUMEL, as shipped (checked below)
STAND_IN_LIMIT = 1 << 14  # the rehearsal's


def sizes(device: str):
    """(the update limit in force, the parameter's elements): 2^31 + 4096 on a GPU."""
    limit = GPU_LIMIT if device == "cuda" else STAND_IN_LIMIT
    return limit, 2 * limit + WINDOW


def windows(n: int, limit: int):
    """(start, length) of each window: the start, each piece boundary (2^31 among them on a GPU), the end."""
    starts = [0] + [k * limit - WINDOW for k in range(1, -(-n // limit))] + [n - WINDOW]
    return [(s, 2 * WINDOW if 0 < s < n - WINDOW else WINDOW) for s in starts]


class Injected:
    """An autograd function whose backward hands the parameter a given gradient (no activations of 9 GB)."""

    @staticmethod
    def make():
        import torch

        class Inject(torch.autograd.Function):
            @staticmethod
            def forward(ctx, weight, grad):
                ctx.grad = grad
                return weight.new_zeros(())

            @staticmethod
            def backward(ctx, _):
                grad, ctx.grad = ctx.grad, None
                return grad, None
        return Inject


def run_path(args, result, fused: bool):
    import bitsandbytes as bnb
    import deepspeed
    import torch

    import deepspeed_bnb  # noqa: F401
    from deepspeed_bnb.ops import rules
    from deepspeed_bnb.ops.reference import AdamHyper
    from deepspeed_bnb.ops import bnb_update
    from deepspeed_bnb.state_layout import GroupLayout
    from support.toy import ds_config

    limit, n = sizes(args.device)
    if args.device == "cuda":
        result.check("e: bnb's update is cut at 2^30 elements as shipped", bnb_update.MAX_UPDATE_NUMEL == GPU_LIMIT,
                     bnb_update.MAX_UPDATE_NUMEL, GPU_LIMIT)
    else:
        bnb_update.MAX_UPDATE_NUMEL = limit  # the stand-in
    dev = torch.device(args.device)
    inject = Injected.make()

    class Huge(torch.nn.Module):
        def __init__(self):
            super().__init__()
            g = torch.Generator(device=dev).manual_seed(0)
            self.weight = torch.nn.Parameter(torch.randn(n, generator=g, device=dev) * 0.02)

        def forward(self, grad):
            return inject.apply(self.weight, grad)

    model = Huge()
    spots = windows(n, limit)
    init = [model.weight.detach()[s:s + w].clone() for s, w in spots]
    setting = bool(fused)  # false: bnb's own update ("auto" is the fused kernel on CPUs and GPUs)
    optimizer = bnb.optim.AdamW8bit(model.parameters(), lr=LR, weight_decay=0.01)
    config = ds_config(1, stage=2, bnb_fused_kernel=setting)
    config["train_micro_batch_size_per_gpu"] = 1
    if args.device != "cuda":  # as DeepSpeed's default buckets (5e8) are to 2^30: the parameter takes ZeRO-2's path
        config["zero_optimization"].update(reduce_bucket_size=limit // 2, allgather_bucket_size=limit // 2)

    engine = deepspeed.initialize(model=model, optimizer=optimizer, config=config)[0]
    zero = engine.optimizer
    master = zero.single_partition_of_fp32_groups[0]  # DP 1, one parameter: partition offset == element index

    def flat_state():
        return zero.optimizer.state[master]

    label = "the fused kernel" if fused else "bnb's own update"
    grads = []
    for step in range(STEPS):
        g = torch.Generator(device=dev).manual_seed(1000 + step)
        grad = torch.randn(n, generator=g, device=dev)
        grads.append([grad[s:s + w].clone() for s, w in spots])
        engine.backward(engine(grad))
        del grad
        engine.step()
    summary = zero.bnb_update_summary()
    result.check(f"e: {label} steps the {n:,}-element parameter", ("fused" in summary) == fused, summary,
                 "the fused kernel" if fused else "bnb's own update")
    state = flat_state()
    mine = [(master[s:s + w].detach().cpu(), {k: state[k][s:s + w].cpu() for k in ("state1", "state2")},
             {k: state[k][s // 256:(s + w) // 256].cpu() for k in ("absmax1", "absmax2")}) for s, w in spots]
    qmaps = [state["qmap1"].cpu(), state["qmap2"].cpu()]
    group = zero.optimizer.param_groups[0]
    del engine, zero, master, state
    if args.device == "cuda":
        torch.cuda.empty_cache()

    mismatches, moved = [], 0
    per_window = [[step_grads[i] for step_grads in grads] for i in range(len(spots))]
    for (s, w), start, window_grads, (weights, codes, absmax) in zip(spots, init, per_window, mine):
        if fused and args.device != "cuda":  # the CPU kernel's pure-torch reference, the window alone
            p = start.cpu().clone()
            ref_codes = [torch.zeros(w, dtype=torch.uint8), torch.zeros(w, dtype=torch.uint8)]
            ref_absmax = [torch.zeros(w // 256), torch.zeros(w // 256)]
            table = rules.segment_table(GroupLayout((w,), 1).segments(0, [True]), [0])
            for t, gw in enumerate(window_grads, start=1):
                hyper = rules.hyper_table([AdamHyper.adamw(group["lr"], *group["betas"], group["eps"],
                                                           group["weight_decay"], t)])
                rules.step_("adam", p, gw.cpu(), ref_codes, ref_absmax, [torch.zeros(0), torch.zeros(0)], qmaps,
                            table, hyper, 1.0, use_kernel=False)
            expected = (p, dict(zip(("state1", "state2"), ref_codes)), dict(zip(("absmax1", "absmax2"), ref_absmax)))
        else:  # plain bnb on the device, the window alone (bnb's path; on a GPU the kernel's arithmetic too)
            p = torch.nn.Parameter(start.clone())
            plain = bnb.optim.AdamW8bit([p], lr=LR, weight_decay=0.01)
            for gw in window_grads:
                p.grad = gw
                plain.step()
            st = plain.state[p]
            expected = (p.detach().cpu(), {k: st[k].cpu() for k in ("state1", "state2")},
                        {k: st[k].cpu() for k in ("absmax1", "absmax2")})
        if not torch.equal(weights, expected[0]):
            mismatches.append(f"[{s}, {s + w}) weights ({common.max_abs(weights, expected[0]):.3g})")
        for key in ("state1", "state2"):
            if not torch.equal(codes[key], expected[1][key]):
                mismatches.append(f"[{s}, {s + w}) {key} ({int((codes[key] != expected[1][key]).sum())} codes)")
        for key in ("absmax1", "absmax2"):
            if not torch.equal(absmax[key], expected[2][key]):
                mismatches.append(f"[{s}, {s + w}) {key}")
        moved += bool((weights != start.cpu()).all())
    reference = ("the kernel's pure-torch reference" if fused and args.device != "cuda"
                 else "plain bnb AdamW8bit on the window")
    result.check(f"e: {label}, every window (start, each 2^30 piece boundary, 2^31, end) == {reference}, weights and "
                 f"state, after {STEPS} steps", not mismatches,
                 "bit for bit" if not mismatches else "; ".join(mismatches[:6]), "bit for bit")
    result.check(f"e: {label}, control: every element of every window moved", moved == len(spots),
                 f"{moved} of {len(spots)} windows", "all")
    result.note(f"{label}: {n:,} elements ({n * 4 / 2**30:.2f} GiB fp32), windows at "
                f"{', '.join(str(s) for s, _ in spots)}; bnb's update in pieces of {limit:,}")
    if args.device == "cuda":
        result.note(f"{label}: peak GPU memory {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB")


def whole_tensor_call(args, result) -> None:
    """What plain bnb's CUDA update does with the whole tensor in one call (the reason for the pieces): a finding for
    the report, not a check (it is bnb's behaviour, not ours). A process of its own: bnb may exit inside its C
    library on a CUDA error."""
    import bitsandbytes as bnb
    import torch
    _, n = sizes(args.device)
    p = torch.nn.Parameter(torch.zeros(n, device=args.device))
    optimizer = bnb.optim.AdamW8bit([p], lr=LR)
    p.grad = torch.ones(n, device=args.device)
    try:
        optimizer.step()
        if args.device == "cuda":
            torch.cuda.synchronize()
    except Exception as exc:
        result.note(f"plain bnb AdamW8bit's step of one {n:,}-element tensor raised {type(exc).__name__}: "
                    f"{str(exc).splitlines()[0][:200]}")
        return
    head, tail = p.detach()[:WINDOW], p.detach()[n - WINDOW:]
    result.note(f"plain bnb AdamW8bit's step of one {n:,}-element tensor ran; its first {WINDOW} elements "
                f"{'moved' if bool((head != 0).all()) else 'did NOT move'}, its last {WINDOW} "
                f"{'moved' if bool((tail != 0).all()) else 'did NOT move'}")


def body(args, result):
    if args.path == "whole":
        whole_tensor_call(args, result)  # notes only: what bnb does is a finding, not a claim of ours
        return
    if args.path:
        common.deterministic(args.device)
        common.one_rank(args.device)
        run_path(args, result, fused=args.path == "fused")
        return
    for path in ("default", "fused", "whole"):  # each in a process of its own: the first path's 40 GB must be gone
        child = os.path.join(args.work, f"large_{path}.json")
        cmd = [sys.executable, os.path.abspath(__file__), "--device", args.device, "--result", child,
               "--work", args.work, "--bundle", args.bundle, "--path", path]
        done = subprocess.run(cmd, timeout=args.child_timeout, check=False, capture_output=True, text=True)
        sys.stdout.write(done.stdout + done.stderr)
        if path == "whole":  # a finding whatever happened
            if not os.path.isfile(child):
                last = (done.stdout + done.stderr).strip().splitlines()[-3:]
                result.note(f"plain bnb AdamW8bit's step of one tensor of 2^31 + {WINDOW} elements ended the "
                            f"process (exit code {done.returncode}): {' | '.join(last)[:400]}")
                continue
        elif not os.path.isfile(child):
            result.check(f"e: the {path} path ran", False, f"exit code {done.returncode}, no result", "a result")
            continue
        with open(child) as f:
            found = json.load(f)
        result.data["notes"] += found["notes"]
        if path == "whole":
            continue
        result.data["checks"] += found["checks"]
        if found["error"]:
            result.check(f"e: the {path} path ran to the end", False, found["error"].strip().splitlines()[-1],
                         "no error")


def extra(parser):
    parser.add_argument("--path", choices=["default", "fused", "whole"], help="run one path in this process")
    parser.add_argument("--child-timeout", type=float, default=240)


if __name__ == "__main__":
    common.run_part("e", "a parameter of more than 2^31 elements", body, extra)
