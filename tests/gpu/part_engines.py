"""GPU proof, parts b and c: a DeepSpeed engine on the one device with bnb AdamW8bit and deepspeed_bnb imported.

b. ZeRO-1, 2 and 3, fp32 and bf16, `bnb_fused_kernel: false` (bitsandbytes' own update):
   after every step, every parameter's fp32 weights and its whole state (codes, absmax, maps, step) equal plain bnb
   AdamW8bit without DeepSpeed on the same model and data, bit for bit. The plain reference of a bf16 engine is
   mixed precision written out by hand: a bf16 copy of the model computes the gradients, bnb steps fp32 master
   weights (made of the bf16 weights, as DeepSpeed makes them) with them (cast to fp32), and the bf16 copy takes the
   rounded masters; which is what ZeRO does at DP 1. With bf16 master weights (ZeRO-2 and 3, `bnb_master_weights`
   "bf16"), plain bnb steps the bf16 model itself; with compensated ones ("bf16+8"), the fp32 masters are split into
   bf16 and error term and joined again after every step (ops/compensated.py); the engine's weights are DeepSpeed's
   fp32 API's (the joined values).
   Control: the weights moved (two untrained models would pass the comparison).
   The same with the default `bnb_fused_kernel: "auto"` over FUSED_STEPS steps, which on a GPU is the fused kernels
   (after their first-use check): they compute bnb's own CUDA arithmetic (every parameter, 32-bit state included, in
   one launch per partition), so they too equal plain bnb bit for bit.
   So do the bf16 engines whose fused kernel also writes the model's copy of the updated weights
   (DEEPSPEED_BNB_KERNEL_LP_COPY=gpu, ZeRO-1/2/3): a wrong copy would change the next step's gradients. Control: the
   kernel wrote the copy at every step after the first.
   The rehearsal on the CPU skips these (the CPU kernels compute the reference's IEEE arithmetic, within one code of
   bnb's CPU path: tests/kernels/test_fused_contract.py).
c. `bnb_fused_kernel: true` (the fused kernel) against the default path on the same run, ZeRO-2, fp32 and bf16:
   before each step the fused engine takes the default engine's weights and state, both take the step, and the
   fused one's codes are within one quantization step of the default's (the relation
   tests/kernels/test_fused_contract.py holds the kernel to on the CPU), its absmax within fp32 noise (on CUDA also
   within bnb's fp32 rounding of 1 - beta: test_fused_contract.fp32_one_minus, measured here at 1.29e-5 for beta2), its
   weights within 1% of the step; over the run, the largest update per element
   of the parameters the kernel steps (|update| / lr, the statistic of benchmarks/compare_adam.py) stays within the
   default path's on the same parameters (5% slack), with no update beyond 10 x lr where the default has none.
   Also with compensated master weights ("bf16+8", bf16 model): the weights then within 1% of the step and one
   error step (1/256 of a bf16 ulp) of the default's, the error terms copied with the state.
   Control: the fused engine's 8-bit parameters are stepped by the kernel, the default's by bnb.
"""

import os
import traceback

import proof_common as common  # first: it puts tests/ on the path
# name -> bnb-shaped state of an engine / of plain bnb
from support.bnb_state import engine_param_states, flat_bnb_state

STAGES = (1, 2, 3)
PRECISIONS = ("fp32", "bf16")
MASTER_MODES = ("bf16", "bf16+8")  # b: bf16 models with bf16 / compensated master weights, at MASTER_STAGES
MASTER_STAGES = (2, 3)
STEPS = 4  # b: steps compared one by one
FUSED_STEPS = 20  # b: steps of the fused engines compared one by one
RELATION_STEPS = 12  # c
LR = 1e-3
UPDATE_SLACK = 1.05  # c: the fused path's largest update may exceed the default's by this factor
BIG_UPDATE = 10.0  # c: an element moving more than this many times its lr in one step is a spike


def batch(step: int, device: str):
    from support.toy import global_batch
    tokens, targets = global_batch(step)
    return tokens.to(device), targets.to(device)


BNB_UPDATE = False  # the setting that makes bnb's own update step every parameter ("auto" is the fused kernel)


def fused_setting(device: str):
    """The setting of the fused runs: "auto" on a GPU (what users get there: the fused kernel, after its first-use
    check), true on the CPU rehearsal."""
    return "auto" if device == "cuda" else True


def engine_of(stage: int, bf16: bool, device: str, fused=None, master="auto"):
    """A one-rank engine of the toy model (fp32 weights at construction; DeepSpeed casts them for bf16); `fused`:
    bnb_fused_kernel (None: bnb's own update, BNB_UPDATE); `master`: bnb_master_weights."""
    import bitsandbytes as bnb
    import deepspeed

    from support.toy import ds_config, make_model, param_groups
    model = make_model(0).to(device)
    optimizer = bnb.optim.AdamW8bit(param_groups(model, lr=LR))
    config = ds_config(1, stage=stage, bf16=bf16, bnb_master_weights=master,
                       bnb_fused_kernel=BNB_UPDATE if fused is None else fused)
    return deepspeed.initialize(model=model, optimizer=optimizer, config=config)[0]


class PlainBnb:
    """plain bnb AdamW8bit on fp32 weights (the masters); with bf16, a bf16 copy of the model computes the gradients.
    `master` "bf16": bnb steps the bf16 model itself; "bf16+8": the masters are split and joined after every step."""

    def __init__(self, device: str, bf16: bool, master: str = "fp32"):
        import bitsandbytes as bnb
        import torch

        from support.toy import clone, make_model, param_groups
        self.compensated = master == "bf16+8"
        self.master = make_model(0).to(device)
        if master == "bf16":
            self.master = self.master.to(torch.bfloat16)
        self.compute = clone(self.master).to(torch.bfloat16) if bf16 and master != "bf16" else self.master
        with torch.no_grad():  # DeepSpeed casts the model first, then makes its fp32 masters of the bf16 weights
            for master, compute in zip(self.master.parameters(), self.compute.parameters()):
                master.copy_(compute.float())
        self.optimizer = bnb.optim.AdamW8bit(param_groups(self.master, lr=LR))

    def step(self, tokens, targets) -> float:
        from support.toy import loss_fn
        loss = loss_fn(self.compute, tokens, targets)
        loss.backward()
        if self.compute is not self.master:
            for master, compute in zip(self.master.parameters(), self.compute.parameters()):
                master.grad = compute.grad.float()
                compute.grad = None
        self.optimizer.step()
        self.optimizer.zero_grad()
        if self.compensated:
            from deepspeed_bnb.ops import compensated
            for master in self.master.parameters():
                master.data.copy_(compensated.join(*compensated.split(master.data)))
        if self.compute is not self.master:
            for master, compute in zip(self.master.parameters(), self.compute.parameters()):
                compute.data.copy_(master.data)
        return loss.item()

    def states(self) -> dict:
        return {name: flat_bnb_state(self.optimizer.state[p], p.numel()) for name, p in self.master.named_parameters()}


def engine_weights(engine) -> dict:
    """name -> the engine's full fp32 (master) weights, from DeepSpeed's own API (gathers at ZeRO-3)."""
    from deepspeed.utils import safe_get_full_fp32_param
    return {name: safe_get_full_fp32_param(p).detach().clone() for name, p in engine.module.named_parameters()}


def state_differences(mine: dict, theirs: dict) -> list:
    """Keys of one parameter's state that differ in keys, dtype or any bit."""
    import torch
    if mine.keys() != theirs.keys():
        return [f"keys {sorted(mine)} vs {sorted(theirs)}"]
    out = []
    for key in mine:
        a, b = mine[key], theirs[key]
        same = (a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b.to(a.device))) \
            if torch.is_tensor(a) else a == b
        if not same:
            out.append(key)
    return out


def count_model_copies(engine) -> list:
    """A one-element list that counts the partition steps in which the kernel wrote the model's copy (PartitionStep.step
    returns True)."""
    written = [0]
    for partition_step in engine.optimizer.bnb_steps:
        step = partition_step.step

        def counting(*args, step=step, **kwargs):
            wrote = step(*args, **kwargs)
            written[0] += bool(wrote)
            return wrote
        partition_step.step = counting
    return written


def equals_plain(args, result, stage: int, precision: str, master: str = "fp32", fused: bool = False,
                 lp_copy: bool = False) -> list:
    """Part b for one configuration (`master`: bnb_master_weights of a bf16 one; `fused`: bnb_fused_kernel true;
    `lp_copy`: the kernel writes the model's copy, DEEPSPEED_BNB_KERNEL_LP_COPY=gpu); returns the table row."""
    from deepspeed_bnb.runtime.zero import lp_copy as lp
    with common.environment({lp.ENV: "gpu"} if lp_copy else {}):
        return _equals_plain(args, result, stage, precision, master, fused, lp_copy)


def _equals_plain(args, result, stage: int, precision: str, master: str, fused: bool, lp_copy: bool = False) -> list:
    from support.toy import make_model
    bf16 = precision == "bf16"
    engine = engine_of(stage, bf16, args.device, fused=fused_setting(args.device) if fused else None,
                       master="auto" if master == "fp32" else master)
    written = count_model_copies(engine)
    plain = PlainBnb(args.device, bf16, master)
    first_bad, worst, bad_states = None, 0.0, set()
    steps = FUSED_STEPS if fused else STEPS
    for step in range(steps):
        tokens, targets = batch(step, args.device)
        from support.toy import loss_fn
        loss = loss_fn(engine, tokens, targets)
        engine.backward(loss)
        engine.step()
        plain.step(tokens, targets)
        mine, theirs = engine_weights(engine), dict(plain.master.named_parameters())
        states, plain_states = engine_param_states(engine), plain.states()
        diff = max(common.max_abs(mine[n], theirs[n]) for n in theirs)
        bad = {f"{n}.{k}" for n in theirs for k in state_differences(states[n], plain_states[n])}
        worst, bad_states = max(worst, diff), bad_states | bad
        if (diff or bad) and first_bad is None:
            first_bad = step + 1
    start = dict(make_model(0).named_parameters())
    moved = max(common.max_abs(mine[n], start[n]) for n in start)
    label = f"ZeRO-{stage} {precision}" + ("" if master == "fp32" else f", {master} master weights")
    summary = engine.optimizer.bnb_update_summary()
    if fused:
        label += ", fused kernel" + (" writing the model's copy" if lp_copy else "")
        expected = f"fused kernel ({args.device.upper()})"
        result.check(f"b: {label}: bnb_fused_kernel {fused_setting(args.device)!r} steps every parameter (32-bit "
                     f"state included) with the fused kernel",
                     summary == expected, summary, expected)
    else:
        result.check(f"b: {label}, bnb_fused_kernel {BNB_UPDATE!r} steps every parameter with bnb's "
                     f"own update", summary == "bnb's own update", summary, "bnb's own update")
    if lp_copy:  # control: the kernel wrote the model's copy at every step but the first (DeepSpeed's whole copy)
        partitions = len(engine.optimizer.bnb_steps)
        result.check(f"b: {label}: the kernel wrote the copy at every step after the first",
                     written[0] == partitions * (steps - 1), f"{written[0]} partition steps",
                     f"{partitions * (steps - 1)} ({partitions} partitions x {steps - 1} steps)")
    result.check(f"b: {label}, weights and state == plain bnb AdamW8bit after each of {steps} steps",
                 first_bad is None and moved > 0,
                 "bit for bit" if first_bad is None else
                 f"first difference after step {first_bad}: weights up to {worst:.3g}, state keys "
                 f"{sorted(bad_states)[:6]}",
                 "bit for bit; weights moved (control)", note=f"weights moved up to {moved:.3g} from their start")
    row = [label, summary, "equal" if first_bad is None else f"step {first_bad}",
           f"{worst:.3g}", len(bad_states), f"{moved:.3g}"]
    del engine
    return row


def copy_run_state(source, target) -> None:
    """target (a ZeRO-2 engine of the same model and config) takes source's weights and optimizer state."""
    import torch
    src, dst = source.optimizer, target.optimizer
    for i in range(len(src.bit16_groups_flat)):
        dst.bit16_groups_flat[i].data.copy_(src.bit16_groups_flat[i].data)
        dst.single_partition_of_fp32_groups[i].data.copy_(src.single_partition_of_fp32_groups[i].data)
        if src.bnb_master_errors[i] is not None:  # compensated master weights: their error terms too
            dst.bnb_master_errors[i].copy_(src.bnb_master_errors[i])
        theirs = src.optimizer.state[src.single_partition_of_fp32_groups[i]]
        mine = dst.optimizer.state[dst.single_partition_of_fp32_groups[i]]
        for key, value in theirs.items():
            if torch.is_tensor(value):
                mine[key].copy_(value)
            else:
                mine[key] = value


def update_sizes(after: dict, before: dict, lrs: dict):
    """(largest |update| / lr over all elements, elements beyond BIG_UPDATE * lr) of one step."""
    largest, spikes = 0.0, 0
    for name, lr in lrs.items():
        moved = (after[name] - before[name]).abs() / lr
        largest = max(largest, float(moved.max()))
        spikes += int((moved > BIG_UPDATE).sum())
    return largest, spikes


def record_partition_steps(engine, into: list) -> None:
    """Every partition step of `engine` appends what it was given (gradient, inv_scale, state before) to `into`:
    the evidence a relation break needs to be replayed offline against bnb's and the kernel's arithmetic."""
    import torch
    for partition_step in engine.optimizer.bnb_steps:
        step = partition_step.step

        def recording(group, params, grads, state, inv_scale=None, master_error=None, step=step, **kwargs):
            into.append({"grad": grads.detach().cpu().clone(), "inv_scale": inv_scale, "weights": params.detach().cpu()
                         .clone(), "state": {k: v.detach().cpu().clone() if torch.is_tensor(v) else v
                                             for k, v in state.items()},
                         "hyper": {k: v for k, v in group.items() if k != "params"}})
            return step(group, params, grads, state, inv_scale, master_error, **kwargs)
        partition_step.step = recording


def partition_states(engine) -> list:
    """Each group's flat partition state, on the CPU."""
    import torch
    opt = engine.optimizer
    return [{k: v.detach().cpu().clone() if torch.is_tensor(v) else v
             for k, v in opt.optimizer.state[p].items()} for p in opt.single_partition_of_fp32_groups]


def fused_against_default(args, result, precision: str, master: str = "auto") -> list:
    """Part c for one precision (and master weights); returns the table row."""
    from deepspeed_bnb.optim.fused.route import FUSED
    from support.fused_relation import relation_breaks
    from support.toy import loss_fn, make_model, param_groups
    bf16 = precision == "bf16"
    default, fused = engine_of(2, bf16, args.device, master=master), engine_of(2, bf16, args.device, fused=True,
                                                                               master=master)
    model = make_model(0)
    groups = param_groups(model, lr=LR)
    names = {id(p): n for n, p in model.named_parameters()}
    lrs, betas = {}, {}
    for group, used in zip(groups, default.optimizer.optimizer.param_groups):  # names -> their group's lr, betas
        for p in group["params"]:
            lrs[names[id(p)]], betas[names[id(p)]] = group["lr"], used["betas"]
    breaks, checked, evidence = [], 0, None
    sizes = {"default": [], "fused": []}
    given = {"default": [], "fused": []}
    record_partition_steps(default, given["default"])
    record_partition_steps(fused, given["fused"])
    for step in range(RELATION_STEPS):
        copy_run_state(default, fused)
        before = engine_weights(default)
        tokens, targets = batch(step, args.device)
        for key in given:
            given[key].clear()
        for engine in (default, fused):
            engine.backward(loss_fn(engine, tokens, targets))
            engine.step()
        after = {"default": engine_weights(default), "fused": engine_weights(fused)}
        states = {"default": engine_param_states(default), "fused": engine_param_states(fused)}
        kernel_steps = {n: lrs[n] for n, r in fused.optimizer.bnb_routes.items() if r is FUSED}
        for key in sizes:  # over the parameters where the two paths differ (elsewhere both are bnb's update)
            sizes[key].append(update_sizes(after[key], before, kernel_steps))
        for name, route in fused.optimizer.bnb_routes.items():
            if route is not FUSED:
                continue
            checked += 1
            mine = {k: v.cpu() if hasattr(v, "cpu") else v for k, v in states["fused"][name].items()}
            bnbs = {k: v.cpu() if hasattr(v, "cpu") else v for k, v in states["default"][name].items()}
            # compensated weights are stored to 1/256 of a bf16 ulp: at most 2^-15 of the weight
            rounding = after["default"][name].cpu().abs() * 2.0 ** -15 if master == "bf16+8" else 0.0
            problems = relation_breaks(mine, bnbs, after["fused"][name].cpu(), after["default"][name].cpu(),
                                       before[name].cpu(), cuda_betas=betas[name] if args.device == "cuda" else None,
                                       w_rounding=rounding)
            breaks += [f"step {step + 1} {name}: {problem}" for problem in problems]
            if problems and evidence is None:  # the first break's inputs and both outcomes, to replay offline
                evidence = {"step": step + 1, "parameter": name, "given": {k: list(v) for k, v in given.items()},
                            "problems": problems,
                            "after": {"default": partition_states(default), "fused": partition_states(fused)},
                            "routes": {n: str(r) for n, r in fused.optimizer.bnb_routes.items()},
                            "layouts": [repr(layout) for layout in getattr(fused.optimizer, "bnb_layouts", [])]}
    if evidence is not None and args.out:
        import torch
        suffix = "_compensated" if master != "auto" else ""
        torch.save(evidence, os.path.join(args.out, f"c_evidence_{precision}{suffix}.pt"))
    routes = fused.optimizer.bnb_routes
    kernel_params = sorted(n for n, r in routes.items() if r is FUSED)
    default_fused = sorted(n for n, r in default.optimizer.bnb_routes.items() if r is FUSED)
    label = f"ZeRO-2 {precision}" + (f", {master} master weights" if master != "auto" else "")
    result.check(f"c: {label}, the fused engine's kernel steps the 8-bit parameters, the default's bnb (control)",
                 bool(kernel_params) and not default_fused,
                 f"kernel: {', '.join(kernel_params) or 'none'}; default engine: "
                 f"{default.optimizer.bnb_update_summary()}", "kernel steps >= 1 parameter, default none")
    rounding = " and bnb's fp32 1 - beta" if args.device == "cuda" else ""
    result.check(f"c: {label}, fused step from the default path's state: codes within one quantization step, absmax "
                 f"within fp32 noise{rounding}, weights within 1% of the step", not breaks and checked > 0,
                 f"{checked} parameter-steps checked, {len(breaks)} breaks" + (f": {breaks[:4]}" if breaks else ""),
                 "no break")
    largest = {key: max(s[0] for s in values) for key, values in sizes.items()}
    spikes = {key: sum(s[1] for s in values) for key, values in sizes.items()}
    result.check(f"c: {label}, the fused path's updates stay in bnb's own range (largest |update| / lr of the "
                 f"parameters it steps, over {RELATION_STEPS} steps; spikes > {BIG_UPDATE:g} x lr)",
                 largest["fused"] <= largest["default"] * UPDATE_SLACK and spikes["fused"] <= spikes["default"],
                 f"fused {largest['fused']:.3f} ({spikes['fused']} spikes), default {largest['default']:.3f} "
                 f"({spikes['default']} spikes)", f"fused <= {UPDATE_SLACK} x default; spikes <= default's")
    result.table(f"c: largest |update| / lr per step, {label} (both from the same state)",
                 ["step", "default (bnb)", "fused kernel"],
                 [[i + 1, f"{d[0]:.3f}", f"{f[0]:.3f}"] for i, (d, f) in enumerate(zip(sizes["default"],
                                                                                    sizes["fused"]))])
    return [label, f"{largest['default']:.3f}", f"{largest['fused']:.3f}", spikes["default"], spikes["fused"],
            checked, len(breaks)]


def body(args, result):
    common.deterministic(args.device)
    common.one_rank(args.device)
    import deepspeed_bnb  # noqa: F401  (before any engine: the import installs the integration)
    # the fused kernels compute bnb's own arithmetic on a GPU only (on the CPU: the reference's)
    kernels = (False, True) if args.device == "cuda" else (False,)
    rows = [equals_plain(args, result, stage, precision, fused=fused)
            for fused in kernels for stage in STAGES for precision in PRECISIONS]
    rows += [equals_plain(args, result, stage, "bf16", master, fused=fused)
             for fused in kernels for stage in MASTER_STAGES for master in MASTER_MODES]
    if args.device == "cuda":  # the kernel writing the model's bf16 copy (an opt-in on GPUs): the same bits
        for stage in STAGES:
            try:
                rows.append(equals_plain(args, result, stage, "bf16", fused=True, lp_copy=True))
            except Exception as exc:  # never run on a GPU before: a failure must not cost the part's other results
                traceback.print_exc()  # into proof.log
                result.check(f"b: ZeRO-{stage} bf16, fused kernel writing the model's copy: the engine trains", False,
                             f"{type(exc).__name__}: {str(exc)[:300]}", "no exception")
    result.table("b: the engine against plain bnb AdamW8bit (default path; on a GPU also the fused kernel)",
                 ["config", "update", "first difference", "max |weight diff|", "state keys differing",
                  "weights moved"], rows)
    rows = [fused_against_default(args, result, precision) for precision in PRECISIONS]
    rows.append(fused_against_default(args, result, "bf16", "bf16+8"))
    result.table("c: bnb_fused_kernel true against the default path, same state before each step",
                 ["config", "largest update / lr, default", "fused", "spikes default", "spikes fused",
                  "parameter-steps checked", "relation breaks"], rows)


if __name__ == "__main__":
    common.run_part("b+c", "engines on the device: bnb's update and the fused kernel against plain bnb", body)
