"""The oldest torch deepspeed_bnb can load checkpoints with, checked at every import (the offline tools' too)."""

from importlib.metadata import PackageNotFoundError, version

from packaging.version import InvalidVersion, Version

TORCH_FLOOR = "2.6"
"""Below it checkpoints cannot be loaded safely at all: torch.serialization.safe_globals appeared in 2.5 (2.4 then
fails every safe load as "truncated, corrupted or was not written by torch.save"), and the weights-only unpickler
admits Python sets (which DeepSpeed's checkpoints hold) from 2.6. Refused even with the opt-in of _versions.py."""


class UnsupportedVersionError(ImportError):
    pass


def require_torch_floor(found=None) -> None:
    """Refuse a torch below TORCH_FLOOR, opt-in or not: with it no checkpoint loads safely (see TORCH_FLOOR)."""
    try:
        found = found or version("torch")
        release = Version(Version(found).base_version)
    except (PackageNotFoundError, InvalidVersion):
        return  # importing torch will say so; an unreadable number is the release check's to name
    if release < Version(TORCH_FLOOR):
        raise UnsupportedVersionError(
            f"deepspeed_bnb: torch {found} is installed; deepspeed_bnb needs torch {TORCH_FLOOR} or later, because it "
            f"loads checkpoints with torch's weights-only unpickler, which gained safe_globals in 2.5 (before, every "
            f"load fails as if the file were damaged) and admits the Python sets DeepSpeed's checkpoints hold from "
            f"2.6. Install a tested torch (docs/versions.md lists them), e.g. pip install 'torch==2.13.*'.")
