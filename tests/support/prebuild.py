"""Every JIT build the suite's launches and background jobs load, done once, before anything with a deadline starts.

Why: DeepSpeed's async_io takes minutes to build on two busy cores. Built inside a launch (its 900 s timeout) or a
part of the GPU proof's rehearsal (its budget), the build is killed with them at their deadline and starts again in
the next one: on a machine running a second suite the same build was started and killed in turn by the rehearsal and
by the NVMe launches, and 29 NVMe tests errored. Built here first, with no deadline but the JIT guard's bounded
waits, every later load only finds it built (a load of a built op takes a second).

BUILD is the script (deepspeed_bnb's kernels, then the named DeepSpeed op builders, each one's outcome printed, none
raising: whoever needs an op that failed reports it); the GPU proof runs it for its parts too (tests/gpu/proof.py).
"""

import os
import subprocess
import sys
from typing import Sequence

# DeepSpeed's CPU ops the suite's ranks and jobs load: the CPU comm op (every launch), CPU Adam (offload), fused Adam
# (DeepSpeed's Adam in the benchmarks and the proof), async_io (NVMe offload; it reports itself where libaio is missing)
SUITE_OPS = ("ShareMemCommBuilder", "CPUAdamBuilder", "FusedAdamBuilder", "AsyncIOBuilder")
OPS_ENV = "DEEPSPEED_BNB_PREBUILD_OPS"  # a run that loads fewer (the compatibility matrix's claims) names them here
BUILD = """import sys, time
from deepspeed_bnb.ops import loader
t = time.monotonic(); loader.load(); print("deepspeed_bnb kernels:", loader.source() or loader.error(),
                                             f"{time.monotonic() - t:.0f} s", flush=True)
from deepspeed.accelerator import get_accelerator
for name in sys.argv[1:]:
    t = time.monotonic()
    try:
        get_accelerator().create_op_builder(name).load()
        print(name + ":", "built", f"{time.monotonic() - t:.0f} s", flush=True)
    except Exception as exc:  # the part or test that needs it reports it
        print(name + ":", "failed:", type(exc).__name__, str(exc)[:200], flush=True)
"""
HANG_GUARD = 3600  # seconds: a first build of every op on two busy cores takes minutes; only a hang takes this long


def suite_ops() -> Sequence[str]:
    """The DeepSpeed ops to build up front: OPS_ENV's comma-separated builder names where set, else SUITE_OPS."""
    chosen = os.environ.get(OPS_ENV, "")
    return tuple(name.strip() for name in chosen.split(",") if name.strip()) if chosen else SUITE_OPS


def build(ops: Sequence[str], env: dict) -> subprocess.CompletedProcess:
    """Run BUILD for `ops` in a fresh process (its output captured); killed, with all it started, only at HANG_GUARD
    (returncode None, and a last line saying so)."""
    from support import process_tree
    done = process_tree.run([sys.executable, "-c", BUILD, *ops], HANG_GUARD, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    if done.returncode is None:
        done.stdout += f"\nkilled after {HANG_GUARD} s"
    return done
