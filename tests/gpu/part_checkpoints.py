"""GPU proof, part d: checkpoints cross devices.

A checkpoint made by 2 CPU ranks (carried in the bundle: cross_device.py) loads on the device at DP 1 and its
continuation equals the CPU's continuation of the same tag at DP 1 (losses within 1e-4, weights within 2% of what
Adam can move them; cross_device.py says why two bars). Control: the same steps without the checkpoint are far
outside both bars. The device then saves its own checkpoint, which a same-size resume on the device continues bit for
bit, and which comes back (gpu_checkpoint.tar, with the device's continuation) for tests/gpu/test_gpu_proof.py to load
at DP 2 on CPU ranks.
"""

import os
import shutil
import tarfile

import proof_common as common
import cross_device as cd

GPU_SAVE = "gpu_checkpoint"  # the save folder inside the tar
GPU_CONTINUATION = "gpu_continuation.pt"  # the device's continuation of tag "gpu", beside the tag in that folder
TAR = "gpu_checkpoint.tar"


def body(args, result):
    import torch

    common.deterministic(args.device)
    common.one_rank(args.device)
    source = os.path.join(args.bundle, "cpu_checkpoint")
    expected = torch.load(os.path.join(source, cd.CONTINUATION), weights_only=True)
    engine = cd.loaded(source, cd.CPU_TAG, args.device, at_step=cd.SAVE_STEP)
    found = cd.continue_run(engine, args.device)
    verdict = cd.compare(expected, found)
    bars = f"losses <= {verdict['loss_bar']:g}, weights <= {cd.WEIGHT_TOLERANCE:g}"
    result.check(f"d: the 2-rank CPU checkpoint loads at DP 1 on {args.device}; its continuation == the CPU's at DP 1",
                 verdict["within"], f"losses {verdict['loss_diff']:.3g} apart, weights {verdict['weight_diff']:.3g}"
                 f"{' (bit for bit)' if verdict['exact'] else ''} over {verdict['steps']} steps", bars)
    control = cd.compare(expected, cd.continue_run(cd.build(1, args.device), args.device, start=cd.SAVE_STEP))
    result.check("d: control, the same steps from a new engine (nothing loaded) are outside the bars",
                 not control["within"], f"losses {control['loss_diff']:.3g} apart, weights "
                 f"{control['weight_diff']:.3g}", "outside " + bars)

    save = os.path.join(args.work, GPU_SAVE)
    shutil.rmtree(save, ignore_errors=True)
    engine.save_checkpoint(save, tag=cd.GPU_TAG)
    continuation = cd.continue_run(engine, args.device)
    torch.save(continuation, os.path.join(save, GPU_CONTINUATION))
    again = cd.compare(continuation, cd.continue_run(cd.loaded(save, cd.GPU_TAG, args.device,
                                                               at_step=continuation["from_step"]), args.device))
    result.check(f"d: the {args.device}'s own checkpoint resumes on it at the same DP size bit for bit",
                 again["exact"], f"losses {again['loss_diff']:.3g} apart, weights {again['weight_diff']:.3g}",
                 "bit for bit")
    tar = os.path.join(args.out or args.work, TAR)
    with tarfile.open(tar, "w") as archive:
        archive.add(save, arcname=GPU_SAVE)
    result.check("d: the device's checkpoint and continuation are packed to come back", os.path.getsize(tar) > 0,
                 f"{tar} ({os.path.getsize(tar) / 1e6:.2f} MB)", "written")
    result.table("d: continuations compared", ["from", "to", "losses apart", "weights apart", "bit for bit"],
                 [[v["from"], v["to"], f"{v['loss_diff']:.3g}", f"{v['weight_diff']:.3g}", v["exact"]]
                  for v in (verdict, control, again)])


if __name__ == "__main__":
    common.run_part("d", "checkpoints cross devices", body)
