"""Launch a benchmark worker as an N-rank CPU job (torchrun, gloo) in a cleaned environment, one job at a time.

The workers end with teardown.finish() (deepspeed_bnb/utils/teardown.py); a job that failed only by gloo's teardown
abort after every rank had finished counts as finished, any other failure raises.
"""

import os
import sys
import time

# free_port: checkpoint_cost imports it from here
from deepspeed_bnb.utils.teardown import run_ranks, unused_port as free_port  # noqa: F401

# Set by an enclosing launcher (or by an in-process one-rank group in tests); a fresh job must pick its own.
INHERITED = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
             "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "CUDA_VISIBLE_DEVICES")


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
    done = run_ranks(cmd, nproc, env=clean_env(), timeout=timeout)
    wall = time.perf_counter() - started
    if log_path:
        with open(log_path, "w") as f:
            f.write(f"$ {' '.join(cmd)}\n{done.stdout}\n{done.stderr}")
            if done.aborted_after_done:
                f.write(f"\nexit {done.returncode}: SIGABRT after every rank had finished (gloo's teardown), "
                        "counted as finished\n")
    if not done.ok:
        raise RuntimeError(done.failure())
    return wall
