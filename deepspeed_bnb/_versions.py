"""The DeepSpeed and bitsandbytes releases deepspeed_bnb is tested with, checked at import.

deepspeed_bnb overrides DeepSpeed ZeRO internals and drives bitsandbytes' optimizer internals; on a release it was
not tested with, it fails at import rather than corrupting optimizer state weeks into a run. The releases accepted
are exactly those that passed every core claim of tools/compat_matrix.md (rerun with tools/compat_matrix.sh): every
DeepSpeed release in the range, and the bitsandbytes releases listed. setup.py requires the same releases. The
offline checkpoint tools skip this check (deepspeed_bnb/__init__.py).
"""

import os
import warnings
from importlib.metadata import PackageNotFoundError, version

from packaging.version import InvalidVersion, Version

DEEPSPEED_RANGE = ("0.16.4", "0.19.8")
"""Every DeepSpeed release from the first to the last: 0.16.4-0.19.6 place the block-aligned ZeRO-1/2 layout with
padding tensors, 0.19.7 on through DeepSpeed's per-parameter padding (runtime/zero/compat.py)."""
BITSANDBYTES = ("0.49.1", "0.49.2", "0.50.2")
"""0.49.x (Axolotl's pin) has no optimizer update on a CPU: there the fused kernel steps every parameter and what it
cannot step is refused (optim/own_update.py); bnb 0.49's own CUDA update is untested here (no GPU)."""
ALLOW_UNTESTED_ENV = "DEEPSPEED_BNB_ALLOW_UNTESTED_VERSIONS"


class UnsupportedVersionError(ImportError):
    pass


def _release(found: str):
    """The final release a version string names (a local build such as 0.19.8+cpu counts as 0.19.8); None for
    pre-, post- and development releases and anything unparsable."""
    try:
        parsed = Version(found)
    except InvalidVersion:
        return None
    if parsed.is_prerelease or parsed.is_postrelease or parsed.is_devrelease:
        return None
    return Version(parsed.base_version)


def is_tested(package: str, found: str) -> bool:
    """Whether `found` is a tested release of `package`."""
    release = _release(found)
    if release is None:
        return False
    if package == "deepspeed":
        first, last = DEEPSPEED_RANGE
        return Version(first) <= release <= Version(last)
    return release in {Version(v) for v in BITSANDBYTES}


def listed(package: str, conjunction: str = "and") -> str:
    """The tested releases of `package` as words: "0.16.4 to 0.19.8", "0.49.1, 0.49.2 and 0.50.2"."""
    if package == "deepspeed":
        return f"{DEEPSPEED_RANGE[0]} to {DEEPSPEED_RANGE[1]}"
    return ", ".join(BITSANDBYTES[:-1]) + f" {conjunction} " + BITSANDBYTES[-1]


def newest(package: str) -> str:
    return DEEPSPEED_RANGE[1] if package == "deepspeed" else BITSANDBYTES[-1]


PACKAGES = ("deepspeed", "bitsandbytes")


def check_versions(installed=None) -> None:
    """Raise (or, with DEEPSPEED_BNB_ALLOW_UNTESTED_VERSIONS=1, warn) when a dependency is not a tested release."""
    problems = []
    for package in PACKAGES:
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
               + " ".join(f"'{p}=={newest(p)}'" for p in PACKAGES) + f"), or set {ALLOW_UNTESTED_ENV}=1 to run "
               "anyway at your own risk (it overrides DeepSpeed ZeRO internals).")
    if os.environ.get(ALLOW_UNTESTED_ENV) == "1":
        warnings.warn(message, RuntimeWarning, stacklevel=2)
    else:
        raise UnsupportedVersionError(message)
