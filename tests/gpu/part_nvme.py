"""GPU proof, part h: ZeRO-3 with the optimizer offloaded to NVMe (ZeRO-Infinity) and bnb AdamW8bit, on the device.

DeepSpeed's async_io op is built first, against the machine's libaio or, where it has none (no libaio-dev, and no
network to install it), against the copy the bundle carries (proof_bundle.libaio: gcc finds the header and library
through CPATH and LIBRARY_PATH, and the library is loaded before the op so the op's dependency resolves).
Then the MLP of tests/support/nvme_scenarios.py (bf16, sub-groups of which two are swapped and one is not) trains 6
steps with `offload_optimizer: {"device": "nvme"}` and again with `"cpu"`, saving after step 3. Checks: the NVMe run's
losses and final fp32 weights equal the CPU-offload run's, bit for bit (DeepSpeed's swapper moves the fp32 partitions
and gradients, deepspeed_bnb's the 8-bit state; the step itself is the same CPU step); the NVMe run's checkpoint, loaded
by a CPU-offload engine built with another seed, continues exactly as the run that never stopped; and with compensated
master weights (bf16 partitions through DeepSpeed's swapper, their int8 error terms through deepspeed_bnb's) the NVMe
run equals its CPU-offload run too. Controls: swap files were written, and the weights moved.
The rehearsal (`--device cpu`) runs the same on a CPU rank with gloo (tests/distributed/test_nvme.py runs it at 2
ranks).
"""

import ctypes
import os
import shutil
import time

import proof_common as common  # first: it puts tests/ on the path

STEPS, SAVE_AT = 6, 3
COMPENSATED = "bf16+8"  # the master weights of the second pair of runs (zero_optimization.bnb_master_weights)


def use_libaio(bundle: str) -> str:
    """Where libaio comes from: the machine, or the bundle's copy (made usable for the build and the load)."""
    if os.path.isfile("/usr/include/libaio.h"):
        return "the machine's"
    carried = os.path.join(bundle, "libaio")
    if not os.path.isfile(os.path.join(carried, "include", "libaio.h")):
        raise RuntimeError(f"no libaio here and none in the bundle ({carried}): run proof_bundle.py --prepare on a "
                           f"machine with libaio-dev")
    for variable, folder in (("CPATH", "include"), ("LIBRARY_PATH", "lib")):
        os.environ[variable] = os.pathsep.join(filter(None, [os.path.join(carried, folder), os.environ.get(variable)]))
    ctypes.CDLL(os.path.join(carried, "lib", "libaio.so.1"), mode=ctypes.RTLD_GLOBAL)
    return "the bundle's copy"


def run(kind: str, folder: str, device: str, seed: int = 0, load_from=None, steps=range(STEPS)):
    """(losses, final fp32 weights, swap files written) of a one-rank engine of `kind`, optionally loading a tag."""
    import bitsandbytes as bnb
    import deepspeed
    import torch
    from deepspeed.utils import safe_get_full_fp32_param

    from support import nvme_scenarios as ns
    model = ns.make_model(seed)
    optimizer = bnb.optim.AdamW8bit(model.parameters(), lr=1e-3, min_8bit_size=4096)
    swap = os.path.join(folder, f"swap_{kind}_{seed}")
    engine = deepspeed.initialize(model=model, optimizer=optimizer, config=ns.config(kind, swap))[0]
    if load_from is not None:
        engine.load_checkpoint(load_from, tag="s")
    losses = []
    for step in steps:
        x, y = ns.batch(step, 1, 0)
        loss = torch.nn.functional.cross_entropy(engine(x.to(device)).float(), y.to(device))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        if step == SAVE_AT - 1 and load_from is None:
            engine.save_checkpoint(os.path.join(folder, f"ckpt_{kind}"), tag="s")
    final = {n: safe_get_full_fp32_param(p).detach().float().cpu().clone() for n, p in engine.module.named_parameters()}
    files = sum(len(f) for _, _, f in os.walk(swap)) if os.path.isdir(swap) else 0
    return losses, final, files


def body(args, result):
    started = time.monotonic()
    source = use_libaio(args.bundle)
    if os.environ.get("TORCH_CUDA_ARCH_LIST"):  # DeepSpeed's builders cannot parse "9.0a" (proof_common)
        os.environ["TORCH_CUDA_ARCH_LIST"] = common.deepspeed_arch_list(os.environ["TORCH_CUDA_ARCH_LIST"])
    from deepspeed.ops.op_builder import AsyncIOBuilder
    loaded = AsyncIOBuilder().is_compatible(verbose=False) and AsyncIOBuilder().load(verbose=False) is not None
    result.check("h: DeepSpeed's async_io op builds and loads", loaded,
                 f"with {source} libaio, in {time.monotonic() - started:.0f} s", "loaded")
    if not loaded:
        return
    common.one_rank(args.device)
    common.deterministic(args.device)
    folder = os.path.join(args.work, "nvme")
    shutil.rmtree(folder, ignore_errors=True)
    os.makedirs(folder)
    cpu_losses, cpu_final, _ = run("cpu", folder, args.device)
    nvme_losses, nvme_final, files = run("opt_nvme", folder, args.device)
    from support import nvme_scenarios as ns
    moved = max(common.max_abs(cpu_final[n], p) for n, p in ns.make_model(0).named_parameters())
    weights = max(common.max_abs(nvme_final[n], cpu_final[n]) for n in cpu_final)
    result.check("h: optimizer on NVMe == CPU offload, losses and fp32 weights after each of 6 steps",
                 nvme_losses == cpu_losses and weights == 0 and files > 0 and moved > 0,
                 f"losses {'equal' if nvme_losses == cpu_losses else 'differ'}, weights up to {weights:.3g} apart; "
                 f"{files} swap files", "bit for bit; swap files written, weights moved (controls)",
                 note=f"weights moved up to {moved:.3g}")
    resumed, resumed_final, _ = run("cpu", folder, args.device, seed=1,
                                    load_from=os.path.join(folder, "ckpt_opt_nvme"), steps=range(SAVE_AT, STEPS))
    apart = max(common.max_abs(resumed_final[n], nvme_final[n]) for n in nvme_final)
    result.check("h: the NVMe run's checkpoint resumes in a CPU-offload engine exactly",
                 resumed == nvme_losses[SAVE_AT:] and apart == 0,
                 f"losses {'equal' if resumed == nvme_losses[SAVE_AT:] else 'differ'}, weights {apart:.3g} apart",
                 "bit for bit")
    rows = [["cpu offload", *[f"{x:.6f}" for x in cpu_losses]], ["nvme", *[f"{x:.6f}" for x in nvme_losses]],
            ["nvme checkpoint resumed", "", "", "", *[f"{x:.6f}" for x in resumed]]]
    # compensated master weights: bf16 partitions in DeepSpeed's swapper, their error terms in ours
    ns.MASTER = COMPENSATED
    try:
        cpu_losses, cpu_final, _ = run("cpu", folder, args.device, seed=2)
        nvme_losses, nvme_final, files = run("opt_nvme", folder, args.device, seed=2)
    finally:
        ns.MASTER = "fp32"
    weights = max(common.max_abs(nvme_final[n], cpu_final[n]) for n in cpu_final)
    result.check(f"h: {COMPENSATED!r} master weights, optimizer on NVMe == CPU offload, losses and weights",
                 nvme_losses == cpu_losses and weights == 0 and files > 0,
                 f"losses {'equal' if nvme_losses == cpu_losses else 'differ'}, weights up to {weights:.3g} apart; "
                 f"{files} swap files", "bit for bit; swap files written (control)")
    rows += [[f"cpu offload, {COMPENSATED}", *[f"{x:.6f}" for x in cpu_losses]],
             [f"nvme, {COMPENSATED}", *[f"{x:.6f}" for x in nvme_losses]]]
    result.table("h: losses", ["run", *[f"step {i + 1}" for i in range(STEPS)]], rows)


if __name__ == "__main__":
    common.run_part("h", "the optimizer on NVMe", body)
