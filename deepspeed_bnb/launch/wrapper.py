"""`deepspeed-bnb run -- COMMAND ...`: run a training command one does not own (llamafactory-cli, axolotl, trl, a
launcher, a script) with deepspeed_bnb active in every Python process it starts, without editing it.

How, as opentelemetry-instrument instruments a program it does not own: the command replaces this process (exec:
its exit code and signals are the command's) with the folder of deepspeed_bnb/bootstrap/sitecustomize.py first on
PYTHONPATH and RUN_ENV set. Python imports `sitecustomize` at startup in every process that inherits that
environment: the command, and every rank the deepspeed launcher, torchrun and accelerate launch start (each passes its
environment on). That module activates deepspeed_bnb right after DeepSpeed is imported, or stops the process with
the reason where it cannot; a process that never imports DeepSpeed is left as it is, and a process started outside
the wrapper never sees any of it. Where the environment already has a sitecustomize, it still runs
(bootstrap/sitecustomize.py chains to it).

The releases are checked here first (the check `import deepspeed_bnb` makes), so an untested DeepSpeed stops the run
before the command starts, not in each rank.
"""

import os
import shutil
import sys
from typing import Dict, List, Mapping

from deepspeed_bnb.launch import RUN_ENV

# the folder of the sitecustomize module (a room of its own: it imports the whole package, nothing imports it)
BOOTSTRAP = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bootstrap")
COMMAND_NOT_FOUND = 127  # the shell's exit code for a command it cannot find (env, opentelemetry-instrument alike)


class CommandNotFound(LookupError):
    """The command to run is not on PATH (nor a path to an executable)."""


def environment(base: Mapping[str, str]) -> Dict[str, str]:
    """`base` with the bootstrap folder first on PYTHONPATH (once) and RUN_ENV set."""
    env = dict(base)
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and os.path.abspath(p) != BOOTSTRAP]
    env["PYTHONPATH"] = os.pathsep.join([BOOTSTRAP] + paths)
    env[RUN_ENV] = "1"
    return env


def resolve_command(command: List[str]) -> str:
    """The executable `command` names; a ValueError without one, CommandNotFound where it does not exist."""
    if not command:
        raise ValueError("it needs the command to run after it, e.g. deepspeed-bnb run -- deepspeed --num_gpus 8 "
                         "train.py --deepspeed ds.json")
    found = shutil.which(command[0])
    if found is None:
        raise CommandNotFound(f"deepspeed-bnb run: {command[0]!r}: command not found (not on PATH, nor a path to an "
                              f"executable file). Install it in this environment, or give its full path.")
    return found


def run(command: List[str]) -> None:
    """Check the releases, then replace this process by `command` under the wrapper's environment."""
    from deepspeed_bnb._versions import check_versions
    if command and command[0] == "--":
        command = command[1:]
    executable = resolve_command(command)
    check_versions()  # UnsupportedVersionError names the release and what is supported
    sys.stdout.flush()  # exec drops what this process has buffered
    sys.stderr.flush()
    os.execve(executable, command, environment(os.environ))
