"""The training frameworks whose own commands `deepspeed-bnb run` was tested with, and which one a process runs.

Why: a framework decides what reaches DeepSpeed (the optimizer it builds from `optim: adamw_bnb_8bit`, the "auto"
values it fills into the DeepSpeed config, how it saves and resumes); a release we have not run may change any of
that. deepspeed_bnb still works with it (it hooks DeepSpeed, not the framework), so an untested release is said once,
by name, with the tested ones, and not refused: refusing would stop runs that are most likely fine, and frameworks
release weekly. The releases are those tests/distributed/test_*_cli.py ran (docs/clients.md says what each measured).
"""

import sys
from importlib.metadata import PackageNotFoundError, version
from typing import Mapping, Optional, Tuple

# import name -> (distribution name, the releases whose command line the suite ran end to end). Order matters:
# LLaMA-Factory and Axolotl import TRL, so the first one a process has imported is the framework it runs.
TESTED = {
    "llamafactory": ("llamafactory", ("0.9.5",)),
    "axolotl": ("axolotl", ("0.19.0",)),
    "trl": ("trl", ("1.16.0",)),
}


def _imported(modules: Mapping[str, object]) -> Optional[Tuple[str, str, Tuple[str, ...]]]:
    """(distribution, installed release, tested releases) of the framework this process runs, judged by what it has
    imported; None when it runs none of them (a script of its own) or the release cannot be read."""
    for name, (distribution, tested) in TESTED.items():
        if name in modules:
            try:
                return distribution, version(distribution), tested
            except PackageNotFoundError:  # imported from a source folder: no release to compare
                return None
    return None


def running(modules: Mapping[str, object] = sys.modules) -> Optional[Tuple[str, str]]:
    """(distribution, installed release) of the framework this process runs; None as _imported says."""
    found = _imported(modules)
    return None if found is None else found[:2]


def untested_release(modules: Mapping[str, object] = sys.modules) -> Optional[str]:
    """A sentence naming the framework release this process runs when it is not one the suite ran; None otherwise."""
    found = _imported(modules)
    if found is None or found[1] in found[2]:
        return None
    distribution, release, tested = found
    return (f"deepspeed-bnb run: {distribution} {release} has not been tested with deepspeed_bnb (tested: "
            f"{', '.join(tested)}). deepspeed_bnb hooks DeepSpeed, not {distribution}, so it should work; if "
            f"{distribution} changed what it passes to DeepSpeed (its optimizer, its DeepSpeed config, how it "
            f"resumes), check a resume at another number of ranks before a long run, or pin a tested release.")
