"""The DeepSpeed and bitsandbytes releases deepspeed_bnb is tested with, checked at import.

deepspeed_bnb overrides DeepSpeed ZeRO internals and drives bitsandbytes' optimizer internals; on a release it was
not tested with, it fails at import rather than corrupting optimizer state weeks into a run. The releases listed are
exactly those that passed every core claim of tools/compat_matrix.md (rerun with tools/compat_matrix.sh); setup.py
requires the same ones.
"""

import os
import warnings
from importlib.metadata import PackageNotFoundError, version

from packaging.version import InvalidVersion, Version

TESTED = {
    # 0.19.7 added the per-parameter padding of ZeRO-1/2 flat groups (`round_robin_bit16_padding`,
    # `flatten_dense_tensors_aligned(param_padding=...)`) that the block-aligned layout is built on; 0.19.0-0.19.6 and
    # 0.18.x lack it and fail every ZeRO claim.
    "deepspeed": ("0.19.7", "0.19.8"),
    # 0.49.2 has no CPU optimizer update (bnb's own `is_on_gpu` check refuses CPU tensors), so the claims that compare
    # with plain bitsandbytes cannot run on a CPU-only machine: untested.
    "bitsandbytes": ("0.50.2",),
}
ALLOW_UNTESTED_ENV = "DEEPSPEED_BNB_ALLOW_UNTESTED_VERSIONS"


class UnsupportedVersionError(ImportError):
    pass


def is_tested(package: str, found: str) -> bool:
    """Whether `found` is one of the tested releases of `package`; a local build (0.19.8+cpu) counts as its release."""
    try:
        release = Version(Version(found).public)
    except InvalidVersion:
        return False
    return release in {Version(v) for v in TESTED[package]}


def listed(package: str, conjunction: str = "and") -> str:
    """The tested releases of `package` as words: "0.19.7 and 0.19.8"."""
    releases = TESTED[package]
    return releases[0] if len(releases) == 1 else ", ".join(releases[:-1]) + f" {conjunction} " + releases[-1]


def check_versions(installed=None) -> None:
    """Raise (or, with DEEPSPEED_BNB_ALLOW_UNTESTED_VERSIONS=1, warn) when a dependency is not a tested release."""
    problems = []
    for package in TESTED:
        try:
            found = (installed or {}).get(package) or version(package)
        except PackageNotFoundError:
            problems.append(f"{package} is not installed (tested: {package} {listed(package)})")
            continue
        if not is_tested(package, found):
            problems.append(f"{package} {found} is installed; deepspeed_bnb is tested with {package} "
                            f"{listed(package)} only")
    if not problems:
        return
    message = ("deepspeed_bnb: " + "; ".join(problems) + ". Install a tested release (pip install "
               + " ".join(f"'{p}=={v[-1]}'" for p, v in TESTED.items()) + f"), or set {ALLOW_UNTESTED_ENV}=1 to run "
               "anyway at your own risk (it overrides DeepSpeed ZeRO internals).")
    if os.environ.get(ALLOW_UNTESTED_ENV) == "1":
        warnings.warn(message, RuntimeWarning, stacklevel=2)
    else:
        raise UnsupportedVersionError(message)
