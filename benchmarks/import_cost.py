"""What importing deepspeed_bnb costs each rank, beside importing DeepSpeed itself (fresh interpreters, interleaved).

    python benchmarks/import_cost.py [--rounds 7]
    PYTHONPATH=/path/to/other/checkout python benchmarks/import_cost.py    # the same for another version

Prints the median wall time of each import statement in a new Python process (torch's own import included in
each, as every rank pays it), and whether bitsandbytes ended up loaded. deepspeed_bnb never imports bitsandbytes
itself: a process whose optimizer is not a bnb one does not pay for it.
"""

import argparse
import os
import statistics
import subprocess
import sys

CASES = {
    "import torch": "import torch",
    "import deepspeed": "import deepspeed",
    "import deepspeed_bnb": "import deepspeed_bnb",
    "import bitsandbytes, deepspeed_bnb": "import bitsandbytes, deepspeed_bnb",
}
PROBE = ("import time, sys\nt = time.perf_counter()\n{}\n"
         "print(time.perf_counter() - t, any(m.split('.')[0] == 'bitsandbytes' for m in sys.modules))")


def measure(statement: str):
    # from the filesystem root: `python -c` puts the working directory first on sys.path, which would shadow the
    # installed package (or the one PYTHONPATH names) with a source tree that happens to be here
    done = subprocess.run([sys.executable, "-c", PROBE.format(statement)], capture_output=True, text=True, check=True,
                          cwd=os.path.abspath(os.sep))
    seconds, bnb = done.stdout.split()[-2:]
    return float(seconds), bnb == "True"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    times = {name: [] for name in CASES}
    loads = {}
    for _ in range(args.rounds):  # interleaved, so a busy moment on a shared machine hits every case alike
        for name, statement in CASES.items():
            seconds, loads[name] = measure(statement)
            times[name].append(seconds)
    base = statistics.median(times["import deepspeed"])
    print(f"| statement ({args.rounds} fresh processes each) | median s | vs import deepspeed | bitsandbytes loaded |")
    print("|---|---:|---:|---|")
    for name, values in times.items():
        median = statistics.median(values)
        print(f"| `{name}` | {median:.2f} | {median / base:.2f}x | {'yes' if loads[name] else 'no'} |")


if __name__ == "__main__":
    main()
