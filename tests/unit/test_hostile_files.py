"""The safe loader refuses every file that would make it do work out of proportion to the file, or read bytes
outside a tensor's own record, before anything is allocated: each attack a few hundred bytes to 200 KB on disk.

For every attack the control shows that torch's own weights-only unpickler (what `torch.load(weights_only=True)`
does, the safe loader's only guard before) accepts the file and builds the oversized or wrong object; then
`load_file` must refuse it with an error naming the file and what is wrong, in a child process whose address space
is capped (an attack that got through would fail there with MemoryError instead of the refusal).
"""

import json
import os
import subprocess
import sys

import pytest
import torch

from support import hostile_files as attack
from conftest import TESTS

# attack -> (what the refusal says, what torch's weights-only unpickler makes of the file: the control)
CASES = {
    "zip_bomb": ("is compressed", lambda x: x.numel() == 1 << 24),
    "storage_past_its_record": ("claims 20 elements of torch.FloatStorage, but its record holds 40 bytes",
                                lambda x: x.numel() == 20 and torch.equal(x[:10], torch.arange(10.0))),
    "stride_zero": ("claims 67,108,864 elements of 4 bytes over a storage of 40 bytes", lambda x: x.numel() == 1 << 26),
    "bytearray_of": ("needs the object builtins.bytearray", lambda x: len(x) == 1 << 28),
    "untyped_storage": ("needs the object torch.storage.UntypedStorage", lambda x: x.nbytes() == 1 << 28),
    "tensor_class": ("needs a call of torch.Tensor", lambda x: x.numel() == 1 << 26),
    "tensor_through_rebuild_from_type": ("a _rebuild_from_type_v2 call of another function",
                                         lambda x: x.numel() == 1 << 26),
    "copies_of_one_string": ("hands the same objects to constructors over and over",
                             lambda x: sum(len(b) for b in x) == 4000 << 16),
    "copies_of_one_list": ("hands the same objects to constructors over and over",
                           lambda x: len(x) == 2000 and all(len(s) == 1 for s in x)),
    "nested_deep": ("nests containers more than 64 deep", lambda x: isinstance(x, list)),
    "loss_scale_zero": ("LossScaler with field cur_scale=0.0", lambda x: x.cur_scale == 0.0),
    "legacy_format": ("legacy torch.save file", lambda x: torch.equal(x, torch.arange(4.0))),
    "stack_global": ("the pickle opcode STACK_GLOBAL", None),  # torch refuses it too, less clearly
    "stage_enum_seven": (r"cannot be read \(ValueError: 7 is not a valid ZeroStageEnum", None),
    "negative_fragment": (r"fragment_address with .*'start': -5", lambda x: x.start == -5),
}
# Loads each file given on the command line in a child whose address space may grow by HEADROOM beyond what its imports
# mapped (tests/support/memory_cap.py): prints the outcome as JSON.
HEADROOM = 512 << 20
CHILD = r"""
import json, sys
import deepspeed_bnb
from deepspeed_bnb.checkpoint.format.safe_load import load_file
from support.memory_cap import cap_above_imports
cap_above_imports(HEADROOM)
out = {}
for path in sys.argv[1:]:
    try:
        load_file(path)
        out[path] = "loaded"
    except Exception as exc:
        out[path] = f"{type(exc).__name__}: {exc}"
print("RESULT " + json.dumps(out))
""".replace("HEADROOM", str(HEADROOM))


WITHOUT_MMAP = ("zip_bomb", "legacy_format")  # torch maps neither (it inflates the one, cannot map the other)


def torch_weights_only(path):
    """What torch.load(weights_only=True) gives, the DeepSpeed value types allowed as the safe loader allows them."""
    from deepspeed_bnb.checkpoint.format.safe_load import allowed_globals
    mmap = not os.path.basename(path).startswith(WITHOUT_MMAP)
    with torch.serialization.safe_globals(allowed_globals()):
        return torch.load(path, weights_only=True, mmap=mmap)["x"]


@pytest.fixture(scope="module")
def crafted(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hostile")
    return {name: getattr(attack, name)(str(folder / f"{name}.pt")) for name in CASES}


@pytest.fixture(scope="module")
def refusals(crafted):
    env = {k: v for k, v in os.environ.items() if k != "DEEPSPEED_BNB_TRUST_CHECKPOINTS"}
    done = subprocess.run([sys.executable, "-c", CHILD, *crafted.values()], capture_output=True, text=True,
                          timeout=600, env=env, cwd=TESTS)
    line = [row for row in done.stdout.splitlines() if row.startswith("RESULT ")]
    assert line, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(line[0][len("RESULT "):])


@pytest.mark.parametrize("name", CASES)
def test_attack_is_refused_by_name(crafted, refusals, name):
    import re
    path, (needle, live) = crafted[name], CASES[name]
    outcome = refusals[path]
    assert outcome.startswith(("CheckpointMismatchError", "UnsafeCheckpointError")), outcome
    assert path in outcome and re.search(needle, outcome), outcome
    if live is not None:  # control: torch's own weights-only unpickler builds the object
        assert live(torch_weights_only(path)), name
    assert os.path.getsize(path) < 250_000, "the attacks are small files"


def test_a_real_checkpoint_file_loads_as_saved(tmp_path):
    """Negative control of the whole list: what torch.save writes (tensors of several dtypes, views, shapes, a
    parameter, nested containers, numbers, strings, bytes, a set) loads unchanged."""
    from deepspeed_bnb.checkpoint.format.safe_load import load_file
    base = torch.arange(24.0).reshape(4, 6)
    value = {"t": base, "view": base[1:, ::2], "t8": torch.arange(300, dtype=torch.uint8), "bf": base.bfloat16(),
             "shape": torch.Size([3, 4]), "p": torch.nn.Parameter(torch.ones(3)), "nested": [{"a": (1, 2.5, "s")}],
             "bytes": b"raw", "set": {1, 2}, "none": None, "big": 10 ** 30}
    path = str(tmp_path / "ok.pt")
    torch.save(value, path)
    loaded = load_file(path)
    assert set(loaded) == set(value)
    for key in ("t", "view", "t8", "bf", "p"):
        assert torch.equal(loaded[key], value[key]), key
    assert {k: loaded[k] for k in ("shape", "nested", "bytes", "set", "none", "big")} == \
        {k: value[k] for k in ("shape", "nested", "bytes", "set", "none", "big")}
