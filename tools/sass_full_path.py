"""What the compiler made of each launch shape of benchmarks/kernel_variants/: per rule and shape, registers, spills,
and the full-block path's machine code (sm_90 SASS from its first 16-byte weight load to the codes' stores): its
instructions, branches, shared-memory loads and MUFU operations. A static view, no GPU needed: the GPU proof's part k
times the same shapes.

    python tools/sass_full_path.py              # compiles kernel_variants.cu for sm_90 (about a minute), prints a table

Needs nvcc and cuobjdump (the CUDA toolkit's; or pip's nvidia-cuda-cuobjdump, searched under site-packages too).
"""

import collections
import glob
import importlib.util
import os
import re
import shutil
import site
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def nvcc_flags() -> list:
    """The kernels' own nvcc flags (deepspeed_bnb/ops/build_flags.py, loaded without the package and its imports)."""
    spec = importlib.util.spec_from_file_location("build_flags", os.path.join(ROOT, "deepspeed_bnb", "ops",
                                                                              "build_flags.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.NVCC_FLAGS


# Tuning<MinBlocks, SplitFull, PrefetchSegment, BlocksPerStep, FastMaps, Staged, Selects> as mangled in the kernel name
SHAPE = re.compile(r"cuda_rules\d+(\w+?)ELNS.*TuningILi(\d)ELb(\d)ELb(\d)ELi(\d)ELb(\d)ELb(\d)ELb(\d)E")


def cuobjdump() -> str:
    found = shutil.which("cuobjdump") or os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin",
                                                      "cuobjdump")
    if os.path.exists(found):
        return found
    for base in site.getsitepackages() + [site.getusersitepackages()]:
        for path in glob.glob(os.path.join(base, "nvidia", "*", "bin", "cuobjdump")):
            return path
    sys.exit("cuobjdump not found: install the CUDA toolkit's, or `pip install nvidia-cuda-cuobjdump`")


def shape_name(match) -> str:
    rule, blocks, split, ahead, per_step, fast, staged, selects = match.groups()
    parts = [f"{blocks} blocks/SM"] + [text for flag, text in (
        (split, "full-block body"), (ahead, "index ahead"), (per_step == "2", "2 blocks per warp step"),
        (fast, "table-only quantizer"), (staged, "staged"), (selects, "selects")) if flag not in ("0", False)]
    return ", ".join(parts)


def full_path(instructions: list) -> list:
    """The full-block body: from the first 16-byte global load to the last of the codes' 8-byte stores after it."""
    first = next(i for i, text in enumerate(instructions) if "LDG.E.128" in text)
    last = next(i for i, text in enumerate(instructions) if i > first and "STG.E.64" in text)
    while last + 1 < len(instructions) and "STG.E.64" in instructions[last + 1]:
        last += 1
    return instructions[first:last + 1]


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        cubin = os.path.join(tmp, "variants.cubin")
        include = [f"-I{os.path.join(ROOT, folder)}" for folder in ("csrc/include", "csrc/cuda",
                                                                     "benchmarks/kernel_variants")]
        build = subprocess.run(["nvcc", "-cubin", "-std=c++17", *nvcc_flags(), *include, "-arch=sm_90", "-Xptxas", "-v",
                                os.path.join(ROOT, "benchmarks", "kernel_variants", "kernel_variants.cu"), "-o", cubin],
                               capture_output=True, text=True)
        if build.returncode:
            sys.stderr.write(build.stderr)
            return 1
        usage, current = {}, None
        for line in build.stderr.splitlines():
            entry = re.search(r"Compiling entry function '(\S+)'", line)
            if entry:
                current = entry.group(1)
            spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line)
            if spill and current:
                usage[current] = {"spills": f"{spill.group(1)}/{spill.group(2)}"}
            registers = re.search(r"Used (\d+) registers", line)
            if registers and current in usage:
                usage[current]["registers"] = registers.group(1)
        sass = subprocess.run([cuobjdump(), "-sass", cubin], capture_output=True, text=True, check=True).stdout
    rows = []
    for function in re.split(r"\n\s*Function : ", sass)[1:]:
        name = function.split("\n")[0].strip()
        match = SHAPE.search(name)
        if not match:
            continue
        instructions = [text.strip() for text in re.findall(r"/\*[0-9a-f]{4,}\*/\s+([^;]*);", function)]
        body = full_path(instructions)
        ops = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", text).split()[0].split(".")[0] for text in body)
        rows.append((match.group(1), shape_name(match), usage.get(name, {}).get("registers", "?"),
                     usage.get(name, {}).get("spills", "?"), len(body), ops["BRA"], ops["LDS"], ops["MUFU"]))
    print("| rule | launch shape | registers | spill stores/loads (bytes) | full path: instructions | branches | "
          "shared loads | MUFU |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for row in sorted(rows):
        print("| " + " | ".join(str(cell) for cell in row) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
