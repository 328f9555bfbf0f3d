"""bitsandbytes 0.49.x for the tests (tests/distributed/test_bnb_049.py): its CPU refusal, simulated under the installed
0.50, and the venv that has the real release.

bnb 0.49 differs from 0.50 where deepspeed_bnb meets it in two ways (read from its source): `functional.is_on_gpu`,
called first by `optimizer_update_8bit_blockwise` and `optimizer_update_32bit`, raises for CPU tensors (0.50 accepts
them and has CPU kernels), and `get_config` returns two more fields, `percentile_clipping` (100) and `block_wise`
(True). `simulate_049` plants both into the installed bnb; the real release runs in its own venv.
"""

import contextlib
import os
import subprocess

LEGACY_PYTHON_ENV = "DEEPSPEED_BNB_BNB049_PYTHON"  # the python of a venv with bitsandbytes 0.49.x (recipe: below)
VENV_RECIPE = ("python3 -m venv VENV && VENV/bin/pip install torch==2.13.0 setuptools wheel && DS_BUILD_OPS=0 "
               "VENV/bin/pip install --no-build-isolation deepspeed==0.19.8 bitsandbytes==0.49.1 ninja packaging "
               "safetensors pytest; then export " + LEGACY_PYTHON_ENV + "=VENV/bin/python")
CPU_REFUSAL = "All input tensors need to be on the same GPU, but found some tensors to not be on a GPU"


def refuse_cpu_like_049(tensors):
    """bnb 0.49's functional.is_on_gpu: any CPU tensor (not paged) is an error."""
    tensors = list(tensors)
    if any(t is not None and not getattr(t, "is_paged", False) and t.device.type == "cpu" for t in tensors):
        raise RuntimeError(f"{CPU_REFUSAL}:\n {[(t.shape, t.device) for t in tensors if t is not None]}")
    return True


@contextlib.contextmanager
def simulate_049(config_fields: bool = True):
    """Within: bitsandbytes behaves as 0.49 on a CPU (no optimizer update of its own; with `config_fields`, 0.49's
    get_config fields at their defaults too)."""
    import bitsandbytes.functional as F
    from bitsandbytes.optim.optimizer import Optimizer8bit

    from deepspeed_bnb.optim import own_update

    real_check, real_config = F.is_on_gpu, Optimizer8bit.get_config

    def get_config(self, gindex, pindex, group):
        return {**real_config(self, gindex, pindex, group), "percentile_clipping": 100, "block_wise": True}

    F.is_on_gpu = refuse_cpu_like_049
    if config_fields:
        Optimizer8bit.get_config = get_config
    own_update._cpu_refusal.cache_clear()
    try:
        yield
    finally:
        F.is_on_gpu, Optimizer8bit.get_config = real_check, real_config
        own_update._cpu_refusal.cache_clear()


def legacy_python():
    """(the python of the bnb 0.49 venv, its bitsandbytes version) or (None, why the tests skip)."""
    python = os.environ.get(LEGACY_PYTHON_ENV)
    if not python:
        return None, f"{LEGACY_PYTHON_ENV} is not set (a venv with bitsandbytes 0.49.x: {VENV_RECIPE})"
    if not os.access(python, os.X_OK):
        return None, f"{LEGACY_PYTHON_ENV}={python} is not an executable"
    done = subprocess.run([python, "-c", "from importlib.metadata import version; print(version('bitsandbytes'))"],
                          capture_output=True, text=True, check=False)
    found = done.stdout.strip()
    if done.returncode != 0 or not found.startswith("0.49."):
        return None, f"{LEGACY_PYTHON_ENV}={python} has no bitsandbytes 0.49.x ({found or done.stderr[-300:]})"
    return python, found
