"""GPU proof, first part: the machine and the software the proof runs on, and that the packages import from where the
bundle put them (DeepSpeed and bitsandbytes carried, deepspeed_bnb from the repository)."""

import os
import platform
import shutil
import subprocess

import proof_common as common


def command_output(cmd) -> str:
    if not shutil.which(cmd[0]):
        return f"{cmd[0]}: not found"
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False)
    return (done.stdout + done.stderr).strip()


def nccl_version() -> str:
    import torch
    version = torch.cuda.nccl.version()  # a tuple in torch 2.x, an int in older releases
    return ".".join(map(str, version)) if isinstance(version, tuple) else str(version)


def body(args, result):
    import torch
    rows = [["python", platform.python_version()], ["torch", f"{torch.__version__} (CUDA {torch.version.cuda})"],
            ["machine", f"{platform.machine()}, {os.cpu_count()} CPUs"],
            ["product CUDA launch shape (DEEPSPEED_BNB_CUDA_SHAPE, proof.py --cuda-shape)",
             os.environ.get("DEEPSPEED_BNB_CUDA_SHAPE") or "each rule's own (csrc/cuda/*_rules.cuh)"]]
    if args.device == "cuda":
        available = torch.cuda.is_available()
        result.check("a CUDA device is visible to torch", available, torch.cuda.device_count(), ">= 1")
        if not available:
            return
        props = torch.cuda.get_device_properties(0)
        rows += [["device", f"{props.name}, {props.total_memory / 2**30:.1f} GiB, {props.multi_processor_count} SMs, "
                            f"compute capability {props.major}.{props.minor}"],
                 ["driver", command_output(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])],
                 ["nvcc", command_output(["nvcc", "--version"]).splitlines()[-1]],
                 ["CUDA_HOME", os.environ.get("CUDA_HOME", "(unset: torch's guess from nvcc)")],
                 ["TORCH_CUDA_ARCH_LIST", os.environ.get("TORCH_CUDA_ARCH_LIST", "(unset: the visible devices')")],
                 ["NCCL", nccl_version()]]
    for name in ("deepspeed", "bitsandbytes", "pydantic", "deepspeed_bnb"):
        try:
            module = __import__(name)
            rows.append([name, f"{getattr(module, '__version__', '?')} from {os.path.dirname(module.__file__)}"])
            result.check(f"{name} imports", True, getattr(module, "__version__", "?"), "imports")
        except Exception as exc:
            result.check(f"{name} imports", False, f"{type(exc).__name__}: {exc}", "imports")
    result.table("environment", ["what", "found"], rows)


if __name__ == "__main__":
    common.run_part("env", "the machine and the software", body)
