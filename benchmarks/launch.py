"""Launch a benchmark worker as an N-rank CPU job (torchrun, gloo) in a cleaned environment, one job at a time."""

import os
import socket
import subprocess
import sys
import time

# Set by an enclosing launcher (or by an in-process one-rank group in tests); a fresh job must pick its own.
INHERITED = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
             "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "CUDA_VISIBLE_DEVICES")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def clean_env(threads_per_rank: int = 1) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in INHERITED}
    # These are CPU benchmarks: pin DeepSpeed to its CPU accelerator even where a GPU is visible, and give each rank
    # its share of the cores (ranks x threads <= cores) so timings are not oversubscription noise.
    env.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS=str(threads_per_rank), PYTHONFAULTHANDLER="1")
    return env


def torchrun(script: str, nproc: int, args, timeout: float = 900, log_path: str | None = None) -> float:
    """Run `script` on `nproc` ranks; return its wall time in seconds. Raise with the output tail if it fails."""
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", f"--master_port={free_port()}",
           script, *map(str, args)]
    started = time.perf_counter()
    done = subprocess.run(cmd, check=False, env=clean_env(), capture_output=True, text=True, timeout=timeout)
    wall = time.perf_counter() - started
    if log_path:
        with open(log_path, "w") as f:
            f.write(f"$ {' '.join(cmd)}\n{done.stdout}\n{done.stderr}")
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited with {done.returncode}:\n{(done.stdout + done.stderr)[-6000:]}")
    return wall
