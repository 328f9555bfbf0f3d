"""Exhaustive check of the CUDA kernels' quantizer: every one of the 2^32 floats, for bitsandbytes' signed and
unsigned dynamic maps, through tests/native/compact_quantizer_check.cpp (the suite's test runs the near-edge subset).

    python tools/compact_quantizer_exhaustive.py      # a few minutes per map on one core; prints the checker's lines

Exit code 1 on any mismatch. Needs g++ and bitsandbytes (for its maps).
"""

import os
import subprocess
import sys
import tempfile

import bitsandbytes.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        binary = os.path.join(tmp, "check")
        subprocess.run(["g++", "-O2", "-std=c++17", f"-I{os.path.join(ROOT, 'csrc', 'include')}",
                        os.path.join(ROOT, "tests", "native", "compact_quantizer_check.cpp"), "-o", binary],
                       check=True)
        failed = False
        for signed in (True, False):
            path = os.path.join(tmp, "map.bin")
            F.create_dynamic_map(signed=signed).float().numpy().tofile(path)
            done = subprocess.run([binary, path, "signed" if signed else "unsigned", "all"], capture_output=True,
                                  text=True)
            print(f"{'signed' if signed else 'unsigned'} map: {done.stdout.strip()}")
            failed |= done.returncode != 0
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
