"""The DeepSpeed, bitsandbytes and torch releases deepspeed_bnb is tested with, checked at import.

deepspeed_bnb overrides DeepSpeed ZeRO internals and drives bitsandbytes' optimizer internals; on a release it was
not tested with, it fails at import rather than corrupting optimizer state weeks into a run. The releases accepted
are exactly those that passed every core claim of tools/compat_matrix.md (rerun with tools/compat_matrix.sh): every
DeepSpeed release in the range, the bitsandbytes releases listed, the torch releases listed. setup.py requires the
same releases. The offline checkpoint tools skip this check (deepspeed_bnb/__init__.py), but not the torch floor:
below it no checkpoint can be loaded safely, and the error torch gives then blames the file.
"""

import os
import re
import warnings
from importlib.metadata import PackageNotFoundError, version

from packaging.version import InvalidVersion, Version

from deepspeed_bnb._torch_floor import UnsupportedVersionError, require_torch_floor  # noqa: F401 (re-exported)

DEEPSPEED_RANGE = ("0.16.4", "0.19.8")
"""Every DeepSpeed release from the first to the last: 0.16.4-0.19.6 place the block-aligned ZeRO-1/2 layout with
padding tensors, 0.19.7 on through DeepSpeed's per-parameter padding (runtime/zero/compat.py)."""
BITSANDBYTES = ("0.49.1", "0.49.2", "0.50.2")
"""0.49.x (Axolotl's pin) has no optimizer update on a CPU: there the fused kernel steps every parameter and what it
cannot step is refused (optim/own_update.py); bnb 0.49's own CUDA update is untested here (no GPU)."""
TORCH = ("2.6", "2.7", "2.8", "2.9", "2.10", "2.11", "2.12", "2.13", "2.14", "2.15")
"""torch, by minor release (a patch release, or a build such as 2.13.0+cpu, counts as its minor release): 2.6.0,
2.7.1, 2.8.0, 2.9.1, 2.10.0, 2.11.0, 2.12.1, 2.13.0, 2.14.1 and 2.15.0 passed the matrix (PyPI's CUDA builds on the
CPU, 2.13.0 the CPU build)."""
ALLOW_UNTESTED_ENV = "DEEPSPEED_BNB_ALLOW_UNTESTED_VERSIONS"


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


def _source_build(package: str, found: str) -> bool:
    """A DeepSpeed built from a git checkout: its number is the next release's (version.txt runs ahead of the
    releases) and its local label the commit (0.19.6+edaa72212), so it is no release at all."""
    local = Version(found).local if _release(found) is not None else None
    return package == "deepspeed" and local is not None and re.fullmatch(r"(g)?[0-9a-f]{7,40}", local) is not None


def is_tested(package: str, found: str) -> bool:
    """Whether `found` is a tested release of `package`."""
    release = _release(found)
    if release is None or _source_build(package, found):
        return False
    if package == "deepspeed":
        first, last = DEEPSPEED_RANGE
        return Version(first) <= release <= Version(last)
    if package == "torch":
        return f"{release.major}.{release.minor}" in TORCH
    return release in {Version(v) for v in BITSANDBYTES}


def listed(package: str, conjunction: str = "and") -> str:
    """The tested releases of `package` as words: "0.16.4 to 0.19.8", "0.49.1, 0.49.2 and 0.50.2"."""
    if package == "deepspeed":
        return f"{DEEPSPEED_RANGE[0]} to {DEEPSPEED_RANGE[1]}"
    releases = TORCH if package == "torch" else BITSANDBYTES
    return ", ".join(releases[:-1]) + f" {conjunction} " + releases[-1]


def newest(package: str) -> str:
    return DEEPSPEED_RANGE[1] if package == "deepspeed" else BITSANDBYTES[-1]


PACKAGES = ("deepspeed", "bitsandbytes")


def check_versions(installed=None) -> None:
    """Raise (or, with DEEPSPEED_BNB_ALLOW_UNTESTED_VERSIONS=1, warn) when a dependency is not a tested release."""
    installed = installed or {}
    require_torch_floor(installed.get("torch"))
    problems = []
    for package in PACKAGES:
        try:
            found = installed.get(package) or version(package)
        except PackageNotFoundError:
            problems.append(f"{package} is not installed (tested: {package} {listed(package)})")
            continue
        if _source_build(package, found):
            problems.append(f"{package} {found} is installed, a build of {package}'s source at commit "
                            f"{Version(found).local} (not a release); deepspeed_bnb is tested with {package} "
                            f"{listed(package)} only")
        elif not is_tested(package, found):
            problems.append(f"{package} {found} is installed; deepspeed_bnb is tested with {package} "
                            f"{listed(package)} only")
    fixes = [f"pip install {' '.join(repr(f'{p}=={newest(p)}') for p in PACKAGES)}"] if problems else []
    try:
        torch = installed.get("torch") or version("torch")
    except PackageNotFoundError:
        torch = None  # importing torch will say so
    if torch is not None and not is_tested("torch", torch):
        problems.append(f"torch {torch} is installed; deepspeed_bnb is tested with torch {listed('torch')} only")
        fixes.append(f"a torch of those, e.g. pip install 'torch=={TORCH[-3]}.*'")
    if not problems:
        return
    message = ("deepspeed_bnb: " + "; ".join(problems) + ". Install a tested release (" + "; ".join(fixes)
               + f"), or set {ALLOW_UNTESTED_ENV}=1 to run anyway at your own risk (it overrides DeepSpeed ZeRO "
               "internals).")
    if os.environ.get(ALLOW_UNTESTED_ENV) == "1":
        warnings.warn(message, RuntimeWarning, stacklevel=2)
    else:
        raise UnsupportedVersionError(message)
