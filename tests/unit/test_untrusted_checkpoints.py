"""A checkpoint from elsewhere cannot run code, and damage or tampering is found before anything changes.

- Pickled payloads (`os.system`) planted in the model-states file and in each rank's optimizer file (with the
  manifest rewritten to match, as an attacker would): `engine.load_checkpoint` and every offline tool refuse with an
  error naming the file and the object, the payload never runs (its marker file stays absent), the engine is
  untouched. Control: the same files loaded with the opt-in (full pickle) do run it, so the payload is live.
- A manifest or `latest` holding a payload, or names that leave the checkpoint directory: refused, naming the file.
- A bit flipped inside tensor data: the load names the file and the tensor (control: torch.load alone reads the
  flipped file without complaint); without its manifest the checkpoint is refused (control: a stock DeepSpeed one
  only warns). The tools refuse it too and write nothing.
- The safe path loads a legitimate checkpoint exactly as the full-pickle path does; a format-1 checkpoint still
  loads, and `deepspeed-bnb migrate` rewrites it in format 2 without changing a byte of state.
- Tool arguments: only bitsandbytes optimizer classes, a non-negative min_8bit_size, a bounded --dp, an output
  directory that is not the source.
"""

import json
import os

import bitsandbytes as bnb
import pytest
import torch

import deepspeed_bnb  # noqa: F401
from support import tampering
from deepspeed_bnb.checkpoint.format.constants import FORMAT_KEY, FORMAT_VERSION, MASTER_MODE_KEY
from deepspeed_bnb.checkpoint.format.errors import CheckpointMismatchError, UnsafeCheckpointError
from deepspeed_bnb.checkpoint.format.manifest import MANIFEST_NAME
from deepspeed_bnb.checkpoint.format.safe_load import TRUST_ENV
from deepspeed_bnb.cli import main
from support.fault_injection import differences, engine_state
from support.tampering import Payload, copy_of, two_rank_checkpoint
from support.toy import MIN_8BIT_SIZE, build_engine, train_steps

TAG = "t"
MODEL_FILE = "mp_rank_00_model_states.pt"
RANK_FILE = "zero_pp_rank_{}_mp_rank_00_optim_states.pt"


@pytest.fixture(scope="module")
def two_ranks(one_rank, tmp_path_factory):
    """A checkpoint of 2 data-parallel ranks (reshaped offline from a 1-rank save) and the state it holds."""
    return two_rank_checkpoint(str(tmp_path_factory.mktemp("untrusted")), TAG)


def fresh_engine():
    return build_engine(seed=1, lr=5e-2, min_8bit_size=MIN_8BIT_SIZE)


def rehash(folder, name):
    tampering.rehash(os.path.join(folder, TAG), name)


def plant(folder, name, marker):
    tampering.plant(os.path.join(folder, TAG), name, marker)


@pytest.fixture
def trusted(monkeypatch):
    monkeypatch.setenv(TRUST_ENV, "1")


@pytest.mark.parametrize("name", [MODEL_FILE, RANK_FILE.format(0), RANK_FILE.format(1)])
def test_payload_never_runs(two_ranks, tmp_path, name):
    source, _ = two_ranks
    folder, marker = copy_of(source, tmp_path), str(tmp_path / "marker")
    plant(folder, name, marker)
    engine = fresh_engine()
    before = engine_state(engine)
    with pytest.raises(UnsafeCheckpointError, match=rf"{name} needs the object posix.system to load.*{TRUST_ENV}=1"):
        engine.load_checkpoint(folder)
    assert not os.path.exists(marker) and not differences(engine_state(engine), before)
    for command in (["inspect", folder, "--verify"], ["reshape", folder, str(tmp_path / "r"), "--dp", "3"],
                    ["export", folder, str(tmp_path / "e")], ["convert", folder, str(tmp_path / "c"), "--to", "32bit"],
                    ["migrate", folder, str(tmp_path / "m")]):
        assert main(command + ["--quiet"] * (command[0] != "inspect")) == 2, command
        assert not os.path.exists(marker), command
    assert not any(os.path.exists(tmp_path / out / "latest") for out in "recm")


def test_payload_runs_with_the_opt_in_control(two_ranks, tmp_path, trusted):
    """The harness plants a live payload: full pickle (the opt-in, and stock DeepSpeed's way) runs it."""
    source, _ = two_ranks
    folder, marker = copy_of(source, tmp_path), str(tmp_path / "marker")
    plant(folder, RANK_FILE.format(1), marker)
    with pytest.warns(RuntimeWarning, match="loaded with full pickle"):
        fresh_engine().load_checkpoint(folder)
    assert os.path.exists(marker)


def test_manifest_and_latest_cannot_carry_payloads(two_ranks, tmp_path):
    source, _ = two_ranks
    marker = str(tmp_path / "marker")
    import pickle
    payload = pickle.dumps(Payload(marker))
    folder = copy_of(source, tmp_path, "manifest")
    with open(os.path.join(folder, TAG, MANIFEST_NAME), "wb") as f:
        f.write(payload)
    with pytest.raises(CheckpointMismatchError, match=rf"{MANIFEST_NAME} is not valid JSON"):
        fresh_engine().load_checkpoint(folder)
    folder = copy_of(source, tmp_path, "latest")
    with open(os.path.join(folder, "latest"), "wb") as f:
        f.write(payload)
    with pytest.raises(CheckpointMismatchError, match=r"latest names the tag .* not a plain name"):
        fresh_engine().load_checkpoint(folder)
    assert main(["inspect", folder]) == 2
    assert not os.path.exists(marker)
    for bad in ("../dp1", "/etc", "t/../../x"):  # names that leave the checkpoint directory
        with open(os.path.join(folder, "latest"), "w") as f:
            f.write(bad)
        with pytest.raises(CheckpointMismatchError, match=r"latest names the tag .* not a plain name"):
            fresh_engine().load_checkpoint(folder)
    folder = copy_of(source, tmp_path, "traversal")
    path = os.path.join(folder, TAG, MANIFEST_NAME)
    with open(path) as f:
        manifest = json.load(f)
    manifest["files"]["../../outside"] = {"bytes": 1, "sha256": "0" * 64}
    with open(path, "w") as f:
        json.dump(manifest, f)
    with pytest.raises(CheckpointMismatchError, match=r"names the file '../../outside'"):
        fresh_engine().load_checkpoint(folder)


def flip_in_tensor(path, tensor: torch.Tensor) -> None:
    """Flip one bit inside the stored bytes of `tensor` (found by its contents, not by our own bookkeeping)."""
    with open(path, "rb") as f:
        data = bytearray(f.read())
    window = tensor.contiguous().view(torch.uint8).reshape(-1).numpy().tobytes()[:64]
    at = data.find(window)
    assert at > 0 and data.find(window, at + 1) < 0, "the window must be unique"
    data[at + 17] ^= 0x10
    with open(path, "wb") as f:
        f.write(data)


def test_bit_flip_names_file_and_tensor(two_ranks, tmp_path):
    source, _ = two_ranks
    folder = copy_of(source, tmp_path)
    path = os.path.join(folder, TAG, RANK_FILE.format(1))
    state1 = torch.load(path, weights_only=False)["optimizer_state_dict"]["base_optimizer_state"]["groups"][0]["state"][
        "state1"]
    flip_in_tensor(path, state1)
    flipped = torch.load(path, weights_only=False)["optimizer_state_dict"]["base_optimizer_state"]["groups"][0][
        "state"]["state1"]
    assert not torch.equal(flipped, state1)  # control: torch reads the damaged file without a word
    engine = fresh_engine()
    before = engine_state(engine)
    expected = rf"{RANK_FILE.format(1)} fails its SHA-256 check .*: tensor data of " \
               r"optimizer_state_dict/base_optimizer_state/groups/0/state/state1 changed since the save"
    with pytest.raises(CheckpointMismatchError, match=expected):
        engine.load_checkpoint(folder)
    assert not differences(engine_state(engine), before)
    for command in (["reshape", folder, str(tmp_path / "r"), "--dp", "1"], ["export", folder, str(tmp_path / "e")],
                    ["convert", folder, str(tmp_path / "c"), "--to", "32bit"], ["inspect", folder, "--verify"]):
        assert main(command + ["--quiet"] * (command[0] != "inspect")) == 2, command
    assert not os.path.exists(tmp_path / "r" / "latest") and not os.path.exists(tmp_path / "c" / "latest")
    assert not os.path.exists(tmp_path / "e" / "model.safetensors")

    os.remove(os.path.join(folder, TAG, MANIFEST_NAME))  # without the manifest: refused, not loaded silently
    with pytest.raises(CheckpointMismatchError, match=rf"has no {MANIFEST_NAME}, but it is a deepspeed_bnb "
                                                      r"checkpoint.*migrate"):
        fresh_engine().load_checkpoint(folder)
    assert main(["inspect", folder]) == 2


def test_stock_checkpoint_without_manifest_only_warns(one_rank, tmp_path):
    stock = build_engine(stock=True)
    train_steps(stock, range(1))
    stock.save_checkpoint(str(tmp_path), tag="s")
    with pytest.warns(RuntimeWarning, match="a stock DeepSpeed checkpoint.*nothing in it can be verified"):
        build_engine().load_checkpoint(str(tmp_path), tag="s", load_optimizer_states=False)


def test_safe_path_loads_what_full_pickle_loads(two_ranks, monkeypatch):
    source, saved = two_ranks
    safe = fresh_engine()
    safe.load_checkpoint(source)
    monkeypatch.setenv(TRUST_ENV, "1")
    full = fresh_engine()
    full.load_checkpoint(source)
    assert not differences(engine_state(safe), engine_state(full))
    assert not differences(engine_state(safe), saved)


def as_format_1(folder):
    """What a format-1 writer left: the same records with format 1 (which named no master weights: fp32), a version-1
    manifest (no per-tensor checksums)."""
    tag_dir = os.path.join(folder, TAG)
    for name in sorted(os.listdir(tag_dir)):
        if "optim_states" in name:
            blob = torch.load(os.path.join(tag_dir, name), weights_only=False)
            blob["optimizer_state_dict"]["base_optimizer_state"][FORMAT_KEY] = 1
            del blob["optimizer_state_dict"]["base_optimizer_state"][MASTER_MODE_KEY]
            torch.save(blob, os.path.join(tag_dir, name))
    with open(os.path.join(tag_dir, MANIFEST_NAME)) as f:
        manifest = json.load(f)
    manifest.update(manifest_version=1, deepspeed_bnb_format=1)
    for entry in manifest["files"].values():
        entry.pop("tensors", None)
    with open(os.path.join(tag_dir, MANIFEST_NAME), "w") as f:
        json.dump(manifest, f)
    for name in manifest["files"]:
        rehash(folder, name)


def test_format_1_loads_and_migrates(two_ranks, tmp_path):
    source, saved = two_ranks
    old = copy_of(source, tmp_path, "v1")
    as_format_1(old)
    engine = fresh_engine()
    engine.load_checkpoint(old)
    assert not differences(engine_state(engine), saved)
    assert main(["migrate", old, str(tmp_path / "v2"), "--quiet"]) == 0
    with open(tmp_path / "v2" / TAG / MANIFEST_NAME) as f:
        manifest = json.load(f)
    assert manifest["manifest_version"] == 2 and all("tensors" in e for n, e in manifest["files"].items()
                                                     if n.endswith(".pt"))
    assert manifest["deepspeed_bnb_format"] == FORMAT_VERSION and manifest["master_weights"] == "fp32"
    record = torch.load(tmp_path / "v2" / TAG / next(n for n in manifest["files"] if "optim_states" in n),
                        weights_only=False)["optimizer_state_dict"]["base_optimizer_state"]
    assert record[FORMAT_KEY] == FORMAT_VERSION and record[MASTER_MODE_KEY] == "fp32"
    migrated = fresh_engine()
    migrated.load_checkpoint(str(tmp_path / "v2"))
    assert not differences(engine_state(migrated), saved)
    assert main(["migrate", old, old, "--quiet"]) == 2  # never over its source


def test_tool_arguments_are_checked(two_ranks, tmp_path, capsys):
    source, _ = two_ranks
    out = str(tmp_path / "out")
    before = {n: open(os.path.join(source, TAG, n), "rb").read() for n in os.listdir(os.path.join(source, TAG))}
    cases = {
        ("convert", "--to", "8bit", "--optimizer-class", "os.system"): "not in the bitsandbytes package",
        ("convert", "--to", "8bit", "--optimizer-class", "bitsandbytes.functional.quantize_blockwise"):
            "not a bitsandbytes optimizer class",
        ("convert", "--to", "8bit", "--optimizer-class", "bitsandbytes.optim.Lion8bit"): "give a class of 'adam'",
        ("convert", "--to", "8bit", "--optimizer-class", "bitsandbytes.optim.AdEMAMix8bit"): "holds 'adam' state",
        ("convert", "--to", "8bit", "--min-8bit-size", "-5"): "must be 0 or more",
        ("reshape", "--dp", "100000"): "--allow-large-dp",
        ("convert", "--to", "32bit", "--dp", "2"): "`deepspeed-bnb reshape` changes those",
    }
    for args, needle in cases.items():
        assert main([args[0], source, out, *args[1:], "--quiet"]) == 2, args
        assert needle in capsys.readouterr().err, args
        assert not os.path.exists(out), args
    for args in (("reshape", "--dp", "2"), ("convert", "--to", "32bit")):
        for target in (source, os.path.join(source, TAG)):
            assert main([args[0], source, target, *args[1:], "--quiet"]) == 2
            assert "would replace the source" in capsys.readouterr().err
    after = {n: open(os.path.join(source, TAG, n), "rb").read() for n in os.listdir(os.path.join(source, TAG))}
    assert after == before
    assert main(["convert", source, out, "--to", "8bit", "--optimizer-class", "bitsandbytes.optim.PagedAdamW8bit",
                 "--quiet"]) == 0  # a real bnb Adam class still converts


def test_a_lion_checkpoint_for_an_adam_class_is_refused_naming_its_rule(one_rank, tmp_path, capsys):
    engine = build_engine(bnb.optim.Lion8bit, min_8bit_size=MIN_8BIT_SIZE)
    train_steps(engine, range(1))
    engine.save_checkpoint(str(tmp_path / "lion"), tag=TAG)
    assert main(["convert", str(tmp_path / "lion"), str(tmp_path / "o"), "--to", "32bit", "--quiet"]) == 2
    assert "holds 'lion' state" in capsys.readouterr().err and not (tmp_path / "o").exists()


class Custom:
    """A caller's own object in client_state: fine to save, but only a trusted load may rebuild it."""

    def __init__(self, value):
        self.value = value


def test_client_state_objects_warn_at_save_and_need_trust(one_rank, tmp_path, monkeypatch):
    engine = build_engine(min_8bit_size=MIN_8BIT_SIZE)
    train_steps(engine, range(1))
    with pytest.warns(RuntimeWarning, match=r"mp_rank_00_model_states.pt.*test_untrusted_checkpoints.Custom.*"
                                            r"DEEPSPEED_BNB_TRUST_CHECKPOINTS"):
        engine.save_checkpoint(str(tmp_path), tag=TAG, client_state={"mine": Custom(3)})
    with pytest.raises(UnsafeCheckpointError, match=r"needs the object test_untrusted_checkpoints.Custom"):
        fresh_engine().load_checkpoint(str(tmp_path))
    monkeypatch.setenv(TRUST_ENV, "1")
    _, client_state = fresh_engine().load_checkpoint(str(tmp_path))
    assert client_state["mine"].value == 3
