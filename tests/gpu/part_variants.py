"""GPU proof, part k: the fused kernels in several launch shapes side by side, each bit for bit with bnb's update.

benchmarks/kernel_variants/ compiles every rule's kernel (bitsandbytes' CUDA arithmetic, fp32 master weights, what a
ZeRO step runs on a GPU) in the shapes fused_step.cuh's Tuning offers: resident thread blocks per SM (the register
budget), a separate body for full blocks, the next block's segment index loaded ahead, two full blocks per warp step,
the quantizer compiled as the compact table alone, the next block's bytes staged in shared memory (cp.async) while a
block is stepped, each element's choices as selects rather than branches. Variant 0 is the product's own shape of
the rule (Rule::Shape in csrc/cuda/*_rules.cuh).
For each rule and variant:
- bit for bit: three steps of a random partition (8-bit and 32-bit segments, block tails of 1, 255, 257 and 4097
  elements, NaN, Inf, huge and tiny gradients) by the variant and by bitsandbytes' own CUDA update on the same state
  (ops/bnb_update.py, the oracle of tests/kernels/test_fused_bnb_cuda.py); every tensor equal after every step;
- speed: one step over a 256M-element partition, the variants interleaved in 20 rounds with a device copy (the
  yardstick, bytes read plus written), each timed as the device's work (bench_cuda_step.event_time); median GB/s of the
  bytes the step must move, its share of the copy, registers per thread and resident blocks per SM.
What the product should compile is read off this table (the fastest exact shape), not assumed.
On the CPU rehearsal there is no device to run them: nvcc builds the variants in tests/kernels/test_cuda_build.py, and
this part checks its own harness (the oracle steps the partition; two steps differ).
"""

import os
import statistics
from types import SimpleNamespace

import proof_common as common

ELEMENTS = 256 << 20
ROUNDS = 20
RULES = (("adam", "AdamW", 16), ("lion", "Lion", 14), ("momentum", "SGD-momentum", 14))  # bytes / element (8-bit)
ODD = ((300_000, 255, 257, 4097, 1000, 1), (True, True, True, True, False, True))  # numels, eight_bit
STEPS = 3
VARIANTS = os.path.join(common.ROOT, "benchmarks", "kernel_variants")


def build(work: str):
    """The variants' operators (torch.ops.dsbnb_variants), JIT-built with the kernels' own flags."""
    import torch
    from torch.utils.cpp_extension import load

    from deepspeed_bnb.ops.build_flags import NVCC_FLAGS
    folder = os.path.join(work, "kernel_variants_build")
    os.makedirs(folder, exist_ok=True)
    load(name="deepspeed_bnb_kernel_variants", sources=[os.path.join(VARIANTS, "kernel_variants.cu"),
                                                        os.path.join(VARIANTS, "kernel_variants_binding.cpp")],
         extra_include_paths=[os.path.join(common.ROOT, "csrc", "include"), os.path.join(common.ROOT, "csrc", "cuda"),
                              VARIANTS],
         extra_cuda_cflags=NVCC_FLAGS, is_python_module=False, build_directory=folder, verbose=False)
    ops = torch.ops.dsbnb_variants
    # `ops.name` is the namespace's own name, and looking the operator `name` up overwrites it, which breaks every
    # later lookup in the namespace (torch 2.11): the others are looked up first, `name` last and explicitly
    step, info, count = ops.step, ops.info, ops.count
    return SimpleNamespace(step=step, info=info, count=count, name=ops.__getattr__("name"))


def state_args(codes, absmax, state, qmaps) -> list:
    """The state tensors of dsbnb_variants::step in its order (codes1, codes2, absmax1, absmax2, state1, state2,
    qmap1, qmap2), from per-moment lists; a rule of one moment passes empty tensors for the second."""
    import torch
    device = codes[0].device
    empty = {"codes": torch.zeros(0, dtype=torch.uint8, device=device), "float": torch.zeros(0, device=device)}
    args = []
    for values, none in ((codes, empty["codes"]), (absmax, empty["float"]), (state, empty["float"]),
                         (qmaps, empty["float"])):
        args += [values[0], values[1] if len(values) > 1 else none]
    return args


def variant_step(ops, rule_index: int, variant: int, partition, step: int, grads) -> None:
    """One step of `partition` by `variant` in place, with the hyper rows the product's step would pass."""
    from deepspeed_bnb.ops import rules
    from support.kernel_harness import BNB_CUDA_CONFIGS
    hyper = rules.get(partition.rule).rows(BNB_CUDA_CONFIGS[partition.rule], step, rules.BNB_CUDA).to(grads.device)
    ops.step(rule_index, variant, partition.params, grads,
             *state_args(partition.codes, partition.absmax, partition.state, partition.qmaps), partition.table, hyper)


def exactness(ops, result) -> dict:
    """Every variant of every rule against bnb's own CUDA update, STEPS steps from a random state; returns
    (rule index, variant) -> whether it held."""
    from support.bnb_cuda_partition import BnbPartition, differences
    held = {}
    for rule_index, (rule, label, _) in enumerate(RULES):
        for variant in range(ops.count()):
            ours = BnbPartition(rule, 11 + rule_index, "cuda", *ODD, dp=1, rank=0, random_start=True)
            oracle = ours.clone()
            found = []
            for step in range(1, STEPS + 1):
                grads = ours.grads(step)
                variant_step(ops, rule_index, variant, ours, step, grads)
                oracle.step(step, grads, use_kernel=False)
                found = differences(ours, oracle)
                if found:
                    found = [f"step {step}: {found[0]}"]
                    break
            held[rule_index, variant] = result.check(
                f"k: {label}, {ops.name(rule_index, variant)} == bitsandbytes' CUDA update, bit for bit, {STEPS} "
                f"steps", not found, found[0] if found else "equal", "equal")
    return held


def rule_times(ops, rule_index: int, copy) -> tuple:
    """Seconds of each variant's step of one rule over one ELEMENTS-long 8-bit segment, and of the copy, interleaved
    in ROUNDS rounds."""
    import torch

    from bench_cuda_step import event_time
    from deepspeed_bnb.ops import rules
    from deepspeed_bnb.state_layout import GroupLayout
    from support.kernel_harness import BNB_CUDA_CONFIGS, QMAPS
    rule = RULES[rule_index][0]
    moments = rules.get(rule).moments
    params, grads = torch.randn(ELEMENTS, device="cuda"), torch.randn(ELEMENTS, device="cuda") * 1e-3
    codes = [torch.full((ELEMENTS,), 127 if s else 0, dtype=torch.uint8, device="cuda")
             for s in rules.SIGNED_MAPS[:moments]]
    absmax = [torch.zeros(ELEMENTS // 256, device="cuda") for _ in range(moments)]
    state = [torch.zeros(0, device="cuda") for _ in range(moments)]
    qmaps = [q.cuda() for q in QMAPS[:moments]]
    table = rules.segment_table(GroupLayout((ELEMENTS,), 1).segments(0, [True]), [0]).cuda()
    hyper = rules.get(rule).rows(BNB_CUDA_CONFIGS[rule][:1], 1, rules.BNB_CUDA).cuda()
    tensors = state_args(codes, absmax, state, qmaps)

    def run(variant):
        return lambda: ops.step(rule_index, variant, params, grads, *tensors, table, hyper)
    steps = [run(v) for v in range(ops.count())]
    for step in steps:
        step()  # warm-up: the cached tables, the first launch
    times, copies = [[] for _ in steps], []
    for _ in range(ROUNDS):
        copies.append(event_time(copy))
        for variant, step in enumerate(steps):
            times[variant].append(event_time(step))
    return times, copies


def speed(ops, result) -> dict:
    """Interleaved timing of every variant over one 256M-element 8-bit segment per rule; returns (rule index,
    variant) -> its share of the copy's bandwidth."""
    import torch
    src = torch.empty(ELEMENTS * 4, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    rows, copy_times, shares = [], [], {}
    for rule_index, (_, label, moved) in enumerate(RULES):
        times, copies = rule_times(ops, rule_index, lambda: dst.copy_(src))
        torch.cuda.empty_cache()
        copy_times += copies
        copy_rate = 2 * src.numel() / statistics.median(copies)
        for variant in range(ops.count()):
            registers, per_sm = ops.info(rule_index, variant)
            median = statistics.median(times[variant])
            rate = ELEMENTS * moved / median
            shares[rule_index, variant] = rate / copy_rate
            rows.append([label, ops.name(rule_index, variant), registers, per_sm, f"{median * 1e3:.3f}",
                         f"{min(times[variant]) * 1e3:.3f}-{max(times[variant]) * 1e3:.3f}", f"{rate / 1e9:,.0f}",
                         f"{rate / copy_rate:.0%}"])
    copy_rate = 2 * src.numel() / statistics.median(copy_times)
    result.table(f"k: one step over {ELEMENTS >> 20}M elements per launch shape ({torch.cuda.get_device_name()}; "
                 f"median of {ROUNDS} interleaved rounds; copy {copy_rate / 1e9:,.0f} GB/s read + written)",
                 ["rule", "launch shape", "registers / thread", "blocks / SM", "ms", "range ms", "GB/s",
                  "of copy"], rows)
    result.check("k: every rule's variants were timed", len(rows) == len(RULES) * ops.count(), len(rows),
                 f"{len(RULES) * ops.count()}")
    return shares


# each rule's product shape: the line in csrc/cuda/<rule>_rules.cuh that names it
SHAPE_LINES = {"adam": ("AdamShape", "adam8bit_rules.cuh"), "lion": ("LionShape", "lion8bit_rules.cuh"),
               "momentum": ("MomentumShape", "momentum8bit_rules.cuh")}


def fastest_exact(held: dict, shares: dict, shapes: dict) -> list:
    """Per rule (RULES' order): (rule, the fastest variant that held bit for bit or None, its share of the copy,
    variant 0's share, the Tuning line that makes it the rule's product shape). `held`, `shares`: (rule index,
    variant) -> exactness and share of the copy; `shapes`: -> Tuning's arguments ("3,true,false,1,true,false,true")."""
    found = []
    for rule_index, (rule, _, _) in enumerate(RULES):
        exact = [v for (r, v), ok in held.items() if r == rule_index and ok and (r, v) in shares]
        best = max(exact, key=lambda v: shares[rule_index, v], default=None)
        line = None
        if best is not None:
            name, header = SHAPE_LINES[rule]
            tuning = shapes[rule_index, best].replace(",", ", ")
            line = f"using {name} = DSBNB_PRODUCT_SHAPE(device::Tuning<{tuning}>);  // csrc/cuda/{header}"
        found.append((rule, best, shares.get((rule_index, best)), shares.get((rule_index, 0)), line))
    return found


def choices(ops, held: dict, shares: dict, result) -> None:
    """The table a session reads its product shapes off: each rule's fastest exact shape, the --cuda-shape value
    that measures it as the product in a later run, and the line that makes it the rule's own."""
    shapes = {(r, v): ops.shape(r, v) for r in range(len(RULES)) for v in range(ops.count())}
    rows = []
    for rule_index, (_, best, share, own, line) in enumerate(fastest_exact(held, shares, shapes)):
        label, own_share = RULES[rule_index][1], f"{own:.0%}" if own is not None else "-"
        if best is None:
            rows.append([label, "none held bit for bit", "-", own_share, "-", "-"])
        else:
            rows.append([label, ops.name(rule_index, best), f"{share:.0%}", own_share,
                         f"`{shapes[rule_index, best]}`", f"`{line}`"])
    result.table("k: each rule's fastest shape that held bit for bit (--cuda-shape measures it as the product; the "
                 "line makes it the rule's own)", ["rule", "fastest exact shape", "of copy", "product's own of copy",
                                                   "--cuda-shape", "line"], rows)


def rehearsal(result) -> None:
    """On the CPU: the harness itself (the oracle steps; a step changes the partition, so equality can fail)."""
    from support.bnb_cuda_partition import BnbPartition, differences
    for rule, label, _ in RULES:
        before = BnbPartition(rule, 11, "cpu", *ODD, dp=1, rank=0, random_start=True)
        after = before.clone()
        after.step(1, after.grads(1), use_kernel=False)
        result.check(f"k: {label}: the oracle's step changes the partition (the comparison can fail)",
                     bool(differences(before, after)), f"{len(differences(before, after))} tensors differ", ">= 1")
    result.note("k: the launch shapes need a GPU to run; tests/kernels/test_cuda_build.py compiles them with nvcc")


def body(args, result):
    if args.device != "cuda":
        rehearsal(result)
        return
    ops = build(args.work)
    result.check("k: the launch-shape variants build", ops.count() > 1, f"{ops.count()} variants", ">= 2")
    held = exactness(ops, result)
    choices(ops, held, speed(ops, result), result)


if __name__ == "__main__":
    common.run_part("k", "the fused kernels' launch shapes, side by side", body)
