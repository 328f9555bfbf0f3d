"""Checkpoints on disk are verifiable and crash-safe: a failed or killed save never costs the previous checkpoint.

- A save writes a manifest (format version, layout, per-file bytes and SHA-256) and moves `latest` only once complete.
- Every step of the publish protocol (PROTOCOL: each call that changes the checkpoint directory, DeepSpeed's own
  writes included) is made to fail in turn, in-process and deterministically (tests/support/fault_injection.py), before
  it happens and, for a non-atomic one, half done; for a new tag and for overwriting the same tag. Each time a fresh
  engine loads exactly the previous checkpoint or exactly the new one (every weight, master weight and optimizer-state
  byte, and the step count), and a later save succeeds and leaves nothing staged behind.
- The one non-atomic moment (overwrite, between retiring the old copy and renaming the new one in) is recovered by
  the next load; and a save from there without that load in between, failing at each of its steps in turn, keeps
  the old checkpoint or publishes the new one too.
- Controls: broken protocols (`latest` moved first; the old tag deleted before the new one is in; no recovery on
  load; stock DeepSpeed's save) fed through the same faults are caught by the same checker.
- One real SIGKILL: a child process killed at that non-atomic moment; a fresh process loads the previous checkpoint.
- A truncated, corrupted or missing file fails the load with an error naming the file, before anything changes.
"""

import contextlib
import json
import os
import shutil
import subprocess
import sys
import zlib

import pytest
import torch

import deepspeed.runtime.engine as ds_engine
from deepspeed_bnb import installer
import deepspeed_bnb.runtime.checkpointing as bnb_engine
from conftest import TESTS, free_port, without_launch_vars
from deepspeed_bnb.checkpoint.format.constants import FORMAT_VERSION
from deepspeed_bnb.checkpoint.format.errors import CheckpointMismatchError
from deepspeed_bnb.checkpoint.format.manifest import MANIFEST_NAME
from deepspeed_bnb.checkpoint.format.publish import RETIRED_SUFFIX, STAGING_SUFFIX, publish, write_json_atomic
from support.fault_injection import differences, engine_state, raises_injected, watch
from support.toy import MIN_8BIT_SIZE, build_engine, train_steps  # 8-bit and fp32 state side by side

OPTIM_FILE = "zero_pp_rank_0_mp_rank_00_optim_states.pt"

# One save of tag {t} on one rank, call by call, as fault_injection.watch records it: (step id, call). Placeholders:
# {s} the staging directory `.{t}<STAGING_SUFFIX>`, {r} the retired copy `.{t}<RETIRED_SUFFIX>`, {m} the manifest.
PROTOCOL = (
    ("mkdir-save-dir", "makedirs ."),  # the checkpoint directory
    ("clear-old-staging", "rmtree {s}"),  # what a failed save of the tag left staged
    ("mkdir-staging", "makedirs {s}"),  # the staging directory, ...
    ("probe-staging", "write {s}/.probe-0"),  # ... which every rank checks it can write to (all fail together)
    ("ds-mkdir-staging", "makedirs {s}"),  # DeepSpeed's own save, into the staging directory: ...
    ("ds-mkdir-tag", "makedirs {s}/{t}"),
    ("ds-write-model", "torch.save {s}/{t}/mp_rank_00_model_states.pt"),
    ("ds-mkdir-tag-again", "makedirs {s}/{t}"),
    ("ds-write-optimizer", "torch.save {s}/{t}/" + OPTIM_FILE),
    ("ds-copy-zero_to_fp32", "copyfile {s}/zero_to_fp32.py"),  # its recovery scripts, beside the tag
    ("ds-chmod-zero_to_fp32", "chmod {s}/zero_to_fp32.py"),
    ("ds-copy-zero_to_torch", "copyfile {s}/zero_to_torch.py"),
    ("ds-chmod-zero_to_torch", "chmod {s}/zero_to_torch.py"),
    ("write-manifest", "write {s}/{t}/{m}.tmp-PID"),  # sizes and SHA-256 of every staged file
    ("name-manifest", "replace {s}/{t}/{m}.tmp-PID -> {s}/{t}/{m}"),
    ("move-zero_to_fp32", "replace {s}/zero_to_fp32.py -> zero_to_fp32.py"),  # the scripts, beside the tags
    ("move-zero_to_torch", "replace {s}/zero_to_torch.py -> zero_to_torch.py"),
    ("clear-old-retired", "rmtree {r}"),  # overwrite only: a retired copy a failed save left
    ("retire-old-tag", "rename {t} -> {r}"),  # overwrite only: the old copy steps aside (recover_tag undoes this)
    ("publish-tag", "rename {s}/{t} -> {t}"),  # the staged tag takes its name
    ("delete-retired", "rmtree {r}"),
    ("delete-staging", "rmtree {s}"),
    ("write-latest", "write latest.tmp-PID"),
    ("move-latest", "replace latest.tmp-PID -> latest"),  # `latest` names the new tag
)
OVERWRITE_ONLY = ("clear-old-retired", "retire-old-tag")
# The calls a crash can also land in the middle of: the file writes, and the one removal that finds files to remove
# in these saves (the others find their directory empty or absent; a crash inside them is a crash before them).
TORN_KINDS, TORN_STEPS = ("torch.save", "copyfile", "write"), (("overwrite", "delete-retired"),)
MODES = {"overwrite": "a", "new-tag": "b"}  # the previous checkpoint is tag "a"; its save is the new one's `latest`


def fill(call, mode):
    tag = MODES[mode]
    return call.format(t=tag, s=f".{tag}{STAGING_SUFFIX}", r=f".{tag}{RETIRED_SUFFIX}", m=MANIFEST_NAME)


def protocol(mode):
    """[(step id, call)] of a save in `mode`, the placeholders filled in."""
    return [(step, fill(call, mode)) for step, call in PROTOCOL if mode == "overwrite" or step not in OVERWRITE_ONLY]


def expected(mode, step):
    """What must load after a save in `mode` failed at `step`: only overwriting publishes before `latest` moves."""
    ids = [s for s, _ in protocol(mode)]
    return "new" if mode == "overwrite" and ids.index(step) > ids.index("publish-tag") else "old"


FAULTS = [(mode, step, False) for mode in MODES for step, _ in protocol(mode)]
FAULTS += [(mode, step, True) for mode in MODES for step, call in protocol(mode)
           if call.split()[0] in TORN_KINDS or (mode, step) in TORN_STEPS]


class Saves:
    """A one-rank engine, its checkpoint `a` after 2 steps (the previous one) and its state one step later (the new
    one, which every save under test writes)."""

    def __init__(self, root):
        self.root = root
        self.engine = build_engine(min_8bit_size=MIN_8BIT_SIZE)
        train_steps(self.engine, range(2))
        self.previous = os.path.join(root, "previous")
        self.engine.save_checkpoint(self.previous, tag="a")
        self.old = engine_state(self.engine)
        train_steps(self.engine, range(2, 3))
        self.new = engine_state(self.engine)
        self.copies = 0

    def copy_of_previous(self) -> str:
        self.copies += 1
        folder = os.path.join(self.root, f"case{self.copies}")
        shutil.copytree(self.previous, folder)
        return folder

    def what_loads(self, folder) -> str:
        """'old' or 'new' when a fresh engine loads exactly one of them from `folder`; otherwise what went wrong."""
        engine = build_engine(seed=1, lr=5e-2, min_8bit_size=MIN_8BIT_SIZE)
        try:
            path, _ = engine.load_checkpoint(folder)
        except Exception as exc:  # any failure to load is a verdict of the checker, reported as such
            return f"the load failed: {type(exc).__name__}: {exc}"
        if path is None:
            return "nothing loaded"
        loaded = engine_state(engine)
        for name in ("old", "new"):
            if not differences(loaded, getattr(self, name)):
                return name
        return (f"a partial checkpoint: differs from the old one in {differences(loaded, self.old)[:4]}, "
                f"from the new one in {differences(loaded, self.new)[:4]}")

    def fail_save(self, mode, index, torn=False):
        """A copy of the previous checkpoint after a save in `mode` failed at its `index`th call; and that call."""
        folder = self.copy_of_previous()
        with watch(folder, fail_at=index, torn=torn) as seen, raises_injected():
            self.engine.save_checkpoint(folder, tag=MODES[mode])
        return folder, str(seen[index])

    def fail_protocol_step(self, mode, step, torn=False) -> str:
        """A copy of the previous checkpoint after a save in `mode` failed at the PROTOCOL step `step`."""
        index = [s for s, _ in protocol(mode)].index(step)
        folder, call = self.fail_save(mode, index, torn)
        assert call == protocol(mode)[index][1], f"the fault landed on {call}, not on {protocol(mode)[index][1]}"
        return folder


def listing(folder):
    return sorted(os.listdir(folder))


@pytest.fixture(scope="module")
def saves(one_rank, tmp_path_factory):
    return Saves(str(tmp_path_factory.mktemp("saves")))


def test_manifest_lists_every_file_with_checksum(saves):
    folder = saves.previous
    with open(os.path.join(folder, "latest")) as f:
        assert f.read() == "a"
    with open(os.path.join(folder, "a", MANIFEST_NAME)) as f:
        manifest = json.load(f)
    on_disk = sorted(n for n in os.listdir(os.path.join(folder, "a")) if n != MANIFEST_NAME)
    assert sorted(manifest["files"]) == on_disk and len(on_disk) >= 2
    assert all(len(entry["sha256"]) == 64 and entry["bytes"] > 0 for entry in manifest["files"].values())
    assert manifest["deepspeed_bnb_format"] == FORMAT_VERSION == 3 and manifest["dp_world_size"] == 1
    assert manifest["groups"][0]["param_names"][0] == "emb.weight"
    # version 2: every tensor's CRC-32, checked here against torch's own loader and zlib
    for name, entry in manifest["files"].items():
        tensors = {}

        def walk(value, prefix):
            if torch.is_tensor(value):
                raw = value.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
                tensors[prefix] = f"{zlib.crc32(raw):08x}"
            elif isinstance(value, dict):
                for key, item in value.items():
                    walk(item, f"{prefix}/{key}" if prefix else str(key))
            elif isinstance(value, (list, tuple)):
                for i, item in enumerate(value):
                    walk(item, f"{prefix}/{i}" if prefix else str(i))
        walk(torch.load(os.path.join(folder, "a", name), weights_only=False), "")
        assert entry["tensors"] == tensors and len(tensors) >= 3, name
    assert "optimizer_state_dict/base_optimizer_state/groups/0/state/state1" in \
        manifest["files"][OPTIM_FILE]["tensors"]
    assert not [n for n in os.listdir(folder) if n.startswith(".")], "staging left behind"
    assert saves.what_loads(folder) == "old"


@pytest.mark.parametrize("mode", MODES)
def test_protocol_is_the_enumerated_steps(saves, mode):
    """The fault tests below cover every step because a save makes exactly the calls PROTOCOL lists."""
    folder = saves.copy_of_previous()
    with watch(folder) as seen:
        saves.engine.save_checkpoint(folder, tag=MODES[mode])
    assert [str(step) for step in seen] == [call for _, call in protocol(mode)]
    assert saves.what_loads(folder) == "new"


@pytest.mark.parametrize("mode,step,torn", FAULTS,
                         ids=[f"{m}-{s}" + ("-torn" if t else "") for m, s, t in FAULTS])
def test_failed_save_keeps_a_complete_checkpoint(saves, mode, step, torn):
    folder = saves.fail_protocol_step(mode, step, torn)
    assert saves.what_loads(folder) == expected(mode, step)
    assert fill("{s}", mode) not in listing(folder), "a failed save leaves its staging directory behind"
    saves.engine.save_checkpoint(folder, tag=MODES[mode])  # a later save, over whatever the failed one left
    assert saves.what_loads(folder) == "new"
    tags = ["a"] if mode == "overwrite" else ["a", "b"]
    assert listing(folder) == sorted(tags + ["latest", "zero_to_fp32.py", "zero_to_torch.py"])


def test_retired_tag_is_recovered_on_load(saves):
    """Killed after the old copy of `a` stepped aside and before the new one took its name: no `a` on disk."""
    folder = saves.fail_protocol_step("overwrite", "publish-tag")
    retired = f".a{RETIRED_SUFFIX}"
    assert {"a", retired} & set(listing(folder)) == {retired}
    assert saves.what_loads(folder) == "old"
    assert "a" in listing(folder) and retired not in listing(folder)


def test_recovery_that_cannot_rename_says_what_to_do(saves, monkeypatch):
    """The same, on a checkpoint that cannot be changed (read-only: the rename back fails): a clear refusal naming
    the retired copy and the fix, the engine untouched; then, the rename done by hand, it loads."""
    folder = saves.fail_protocol_step("overwrite", "publish-tag")
    retired = os.path.join(folder, f".a{RETIRED_SUFFIX}")
    real_rename = os.rename

    def read_only(src, dst):
        raise OSError(30, "Read-only file system", src)
    monkeypatch.setattr(os, "rename", read_only)
    engine = build_engine(seed=1, lr=5e-2, min_8bit_size=MIN_8BIT_SIZE)
    before = engine_state(engine)
    with pytest.raises(CheckpointMismatchError, match=rf"waits in {retired} and cannot be put back .*Read-only file "
                                                      rf"system.*Rename that directory to {os.path.join(folder, 'a')}"):
        engine.load_checkpoint(folder)
    assert not differences(engine_state(engine), before)
    monkeypatch.setattr(os, "rename", real_rename)
    os.rename(retired, os.path.join(folder, "a"))
    assert saves.what_loads(folder) == "old"


# From that moment the next save of `a` (no load in between) finds no `a` to retire: the overwrite's calls without
# the two retire steps, the old checkpoint living on as the retired copy until the new one is in place.
AFTER_INTERRUPTED_OVERWRITE = [(step, call) for step, call in protocol("overwrite") if step not in OVERWRITE_ONLY]


@pytest.mark.parametrize("step", [step for step, _ in AFTER_INTERRUPTED_OVERWRITE] + ["none"])
def test_save_after_an_interrupted_overwrite_without_a_load(saves, step):
    """That save, failing at each of its steps in turn (or at none), keeps the old checkpoint or publishes the new."""
    folder = saves.fail_protocol_step("overwrite", "publish-tag")
    ids, calls = zip(*AFTER_INTERRUPTED_OVERWRITE)
    index = ids.index(step) if step in ids else None
    with watch(folder, fail_at=index) as seen, \
            (raises_injected() if index is not None else contextlib.nullcontext()):
        saves.engine.save_checkpoint(folder, tag="a")
    upto = len(calls) if index is None else index + 1
    assert [str(call) for call in seen][:upto] == list(calls[:upto])  # then DeepSpeed's rest, and the clean-up
    assert f".a{STAGING_SUFFIX}" not in listing(folder), "a failed save leaves its staging directory behind"
    published = index is None or index > ids.index("publish-tag")
    assert saves.what_loads(folder) == ("new" if published else "old")
    saves.engine.save_checkpoint(folder, tag="a")
    assert listing(folder) == ["a", "latest", "zero_to_fp32.py", "zero_to_torch.py"]
    assert saves.what_loads(folder) == "new"


# Negative controls: protocols with a known hole, fed through the same faults; the checker must catch each.
def latest_first(save_dir, tag, files, description, save_latest):
    """`latest` moved before the tag is in place (what stock DeepSpeed's rank 0 does before other ranks finish)."""
    write_json_atomic(os.path.join(save_dir, "latest"), tag)
    publish(save_dir, tag, files, description, False)


def delete_then_rename(save_dir, tag, files, description, save_latest):
    """The old copy deleted before the new one takes its name, instead of stepping aside."""
    shutil.rmtree(os.path.join(save_dir, tag), ignore_errors=True)
    publish(save_dir, tag, files, description, save_latest)


# name -> (attribute of deepspeed_bnb.runtime.checkpointing replaced, by what, mode, a call a fault must catch)
BROKEN = {
    "latest-first": ("publish", latest_first, "new-tag", "rename {s}/{t} -> {t}"),
    "delete-then-rename": ("publish", delete_then_rename, "overwrite", "rename {s}/{t} -> {t}"),
    "no-recovery-on-load": ("recover_tag", lambda load_dir, tag: None, "overwrite", "rename {s}/{t} -> {t}"),
    "stock-deepspeed-save": ("save_checkpoint", None, "overwrite", "torch.save {t}/" + OPTIM_FILE),
}


@pytest.mark.parametrize("variant", BROKEN)
def test_broken_protocol_is_caught(saves, monkeypatch, variant):
    """The checker above, over every step of a broken protocol: it must report a partial or missing checkpoint."""
    name, replacement, mode, hole = BROKEN[variant]
    if name == "save_checkpoint":  # DeepSpeed's own save: straight into the tag directory, `latest` after rank 0
        monkeypatch.setattr(ds_engine.DeepSpeedEngine, name, installer.stock(f"DeepSpeedEngine.{name}"))
    else:
        monkeypatch.setattr(bnb_engine, name, replacement)
    clean = saves.copy_of_previous()
    with watch(clean) as calls:
        saves.engine.save_checkpoint(clean, tag=MODES[mode])
    caught = {}
    for index, call in enumerate(calls):
        verdict = saves.what_loads(saves.fail_save(mode, index)[0])
        if verdict not in ("old", "new"):
            caught[str(call)] = verdict
    assert fill(hole, mode) in caught, f"{variant}: a fault at {fill(hole, mode)} went unnoticed; caught: {caught}"


@pytest.mark.slow  # a fresh process that imports DeepSpeed, saves and is killed
def test_sigkill_at_the_non_atomic_moment(one_rank, tmp_path):
    """A real SIGKILL (no unwinding, no cleanup) in a child, between retiring `a` and publishing its new copy."""
    folder, reference = str(tmp_path / "killed"), str(tmp_path / "reference.pt")
    index = [s for s, _ in protocol("overwrite")].index("publish-tag")
    cmd = [sys.executable, os.path.join(TESTS, "support", "save_then_die.py"), "--dir", folder, "--kill-at", str(index),
           "--reference", reference, "--port", str(free_port())]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=without_launch_vars())
    assert done.returncode == -9, f"expected SIGKILL, got {done.returncode}: {(done.stdout + done.stderr)[-3000:]}"
    assert "a" not in listing(folder) and f".a{RETIRED_SUFFIX}" in listing(folder), listing(folder)
    engine = build_engine(seed=1, lr=5e-2, min_8bit_size=MIN_8BIT_SIZE)
    assert engine.load_checkpoint(folder)[0] is not None
    assert differences(engine_state(engine), torch.load(reference, weights_only=False)) == []
    engine.save_checkpoint(folder, tag="a")  # and the next save, over what the killed one left staged
    assert listing(folder) == ["a", "latest", "zero_to_fp32.py", "zero_to_torch.py"]


def damaged(saves, tmp_path, damage):
    folder = str(tmp_path / "damaged")
    shutil.copytree(saves.previous, folder)
    victim = os.path.join(folder, "a", OPTIM_FILE)
    damage(victim)
    return folder, victim


def truncate(path):
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


def flip_byte(path):
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0xFF]))


@pytest.mark.parametrize("damage,needle", [(truncate, "truncated"), (flip_byte, "SHA-256"), (os.remove, "missing")],
                         ids=["truncated", "corrupted", "missing"])
def test_damaged_file_is_named(saves, tmp_path, damage, needle):
    folder, victim = damaged(saves, tmp_path, damage)
    engine = build_engine(seed=1, min_8bit_size=MIN_8BIT_SIZE)
    before = engine_state(engine)
    with pytest.raises(CheckpointMismatchError) as failure:
        engine.load_checkpoint(folder)
    assert victim in str(failure.value) and needle in str(failure.value)
    assert differences(before, engine_state(engine)) == [], "a refused load changed the engine"


def test_missing_rank_file_without_manifest_is_named(saves, tmp_path):
    """Without a manifest (removed), the loader itself names the missing rank file."""
    folder, victim = damaged(saves, tmp_path, os.remove)
    os.remove(os.path.join(folder, "a", MANIFEST_NAME))
    with pytest.raises(CheckpointMismatchError, match=f"{OPTIM_FILE} is missing"):
        build_engine(seed=1, min_8bit_size=MIN_8BIT_SIZE).load_checkpoint(folder)
