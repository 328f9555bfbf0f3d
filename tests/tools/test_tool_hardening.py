"""The offline tools and the loader on hostile or damaged checkpoints: bounded work, clear errors, nothing written.

- Writers never follow a link standing at one of their own output names (the staging directory, an export file):
  the link's target stays as it was. Control: a naive writer at the same path writes into the target.
- `--trust` given to an in-process `cli.main` call holds for that call only.
- Legacy or raw-pickle files, malformed records (wrong types, impossible layouts, tensors of the wrong size, a step
  that is no number), subdirectories a manifest does not list, nonsense values of the allowed DeepSpeed types: the
  load and every verb refuse, naming the file, and write nothing.
- Counts read from files are checked against the files before anything is allocated: a DP size of 10^9 in the model
  states, layouts claiming a thousand times the elements the rank files hold, a zip bomb given to --from-bnb. Each
  verb runs in a child whose address space is capped, where an allocation of that size would fail with MemoryError
  instead of the refusal.
- A failed run leaves no staging directory, no `latest`, no partial output.
"""

import json
import os
import subprocess
import sys

import bitsandbytes as bnb
import pytest
import torch

import deepspeed_bnb  # noqa: F401
from support import hostile_files
from support import tampering
from conftest import TESTS
from deepspeed_bnb.checkpoint.format.errors import CheckpointMismatchError
from deepspeed_bnb.checkpoint.format.manifest import MANIFEST_NAME
from deepspeed_bnb.checkpoint.format.safe_load import TRUST_ENV, allowed_globals, trusted
from deepspeed_bnb.cli import main
from support.fault_injection import differences, engine_state
from support.tampering import Payload, copy_of, two_rank_checkpoint
from support.toy import MIN_8BIT_SIZE, build_engine, train_steps

TAG = "t"
MODEL = "mp_rank_00_model_states.pt"
RANK = "zero_pp_rank_{}_mp_rank_00_optim_states.pt"
VERBS = {  # verb -> argv after the checkpoint, with {out} for the output directory
    "inspect": ["--verify"], "reshape": ["{out}", "--dp", "3", "--quiet"], "migrate": ["{out}", "--quiet"],
    "export": ["{out}", "--optimizer-state", "--quiet"], "convert": ["{out}", "--to", "32bit", "--quiet"],
}


@pytest.fixture(scope="module")
def two_ranks(one_rank, tmp_path_factory):
    return two_rank_checkpoint(str(tmp_path_factory.mktemp("tools")), TAG)


def rehash(folder, name):
    tampering.rehash(os.path.join(folder, TAG), name)


def rewrite(folder, name, change):
    tampering.rewrite(os.path.join(folder, TAG), name, change)


def record(blob):
    return blob["optimizer_state_dict"]["base_optimizer_state"]


def run_verbs(folder, tmp_path, capsys, verbs=VERBS):
    """{verb: (exit code, stderr)} of every verb on `folder`; asserts that none wrote an output."""
    results = {}
    for verb, args in verbs.items():
        out = str(tmp_path / f"out_{verb}")
        code = main([verb, folder, *[a.format(out=out) for a in args]])
        results[verb] = (code, capsys.readouterr().err)
        assert not os.path.exists(out) or not os.listdir(out), f"{verb} wrote {os.listdir(out)}"
    return results


# ---- writers and links -----------------------------------------------------------------------------------------------

def victim_untouched(victim, before) -> bool:
    return sorted(os.listdir(victim)) == sorted(before) and all(
        open(os.path.join(victim, n), "rb").read() == data for n, data in before.items())


@pytest.mark.parametrize("verb,args", [("reshape", ["--dp", "2"]), ("convert", ["--to", "32bit"]), ("migrate", []),
                                       ("export", ["--universal"])])
def test_writers_never_follow_a_link_at_their_staging_name(two_ranks, tmp_path, verb, args):
    source, _ = two_ranks
    victim = str(tmp_path / "victim")
    os.makedirs(victim)
    with open(os.path.join(victim, "keep.txt"), "w") as f:
        f.write("someone else's file")
    before = {"keep.txt": b"someone else's file"}
    out = str(tmp_path / "out")
    os.makedirs(out)
    link = os.path.join(out, f".{TAG}.deepspeed_bnb-partial")
    os.symlink(victim, link)
    assert main([verb, source, out, *args, "--quiet"]) == 0
    assert victim_untouched(victim, before), os.listdir(victim)
    assert not os.path.lexists(link) and os.path.isfile(os.path.join(out, TAG, MANIFEST_NAME))
    os.symlink(victim, link)  # control: a writer that follows the link writes into its target
    os.makedirs(os.path.join(link, TAG), exist_ok=True)
    assert not victim_untouched(victim, before)


def test_export_replaces_links_at_its_output_names(two_ranks, tmp_path):
    source, _ = two_ranks
    out, victim = str(tmp_path / "out"), str(tmp_path / "victim")
    os.makedirs(out)
    os.makedirs(victim)
    for name in ("optimizer.json", "model.safetensors"):
        with open(os.path.join(victim, name), "w") as f:
            f.write("someone else's file")
        os.symlink(os.path.join(victim, name), os.path.join(out, name))
    assert main(["export", source, out, "--optimizer-state", "--quiet"]) == 0
    for name in ("optimizer.json", "model.safetensors"):
        assert open(os.path.join(victim, name)).read() == "someone else's file", name
        assert os.path.isfile(os.path.join(out, name)) and not os.path.islink(os.path.join(out, name)), name
    from safetensors.torch import load_file
    assert "emb.weight" in load_file(os.path.join(out, "model.safetensors"))
    assert not [n for n in os.listdir(out) if ".tmp-" in n]


def test_trust_flag_holds_for_one_call(two_ranks, tmp_path, monkeypatch):
    monkeypatch.delenv(TRUST_ENV, raising=False)
    source, _ = two_ranks
    folder, marker = copy_of(source, tmp_path), str(tmp_path / "marker")
    rewrite(folder, MODEL, lambda blob: blob.update(planted=Payload(marker)))
    with pytest.warns(RuntimeWarning, match="loaded with full pickle"):
        assert main(["inspect", folder, "--trust"]) == 0
    assert os.path.exists(marker)  # the opt-in did apply to that call (the payload ran)
    assert not trusted() and TRUST_ENV not in os.environ
    os.remove(marker)
    assert main(["inspect", folder]) == 2 and not os.path.exists(marker)


# ---- clear errors, nothing written -----------------------------------------------------------------------------------

@pytest.mark.parametrize("form", ["legacy", "raw pickle"])
def test_legacy_and_raw_pickle_files_are_named(two_ranks, tmp_path, capsys, form):
    source, _ = two_ranks
    folder = copy_of(source, tmp_path)
    path = os.path.join(folder, TAG, RANK.format(1))
    blob = torch.load(path, weights_only=False)
    if form == "legacy":
        torch.save(blob, path, _use_new_zipfile_serialization=False)
    else:
        import pickle
        with open(path, "wb") as f:
            pickle.dump({"optimizer_state_dict": {}}, f)
    rehash(folder, RANK.format(1))
    needle = "a raw pickle or a legacy torch.save file"
    with pytest.raises(CheckpointMismatchError, match=needle):
        build_engine(seed=1, min_8bit_size=MIN_8BIT_SIZE).load_checkpoint(folder)
    for verb, (code, err) in run_verbs(folder, tmp_path, capsys).items():
        assert code == 2 and needle in err and RANK.format(1) in err, (verb, err)


def _groups_not_a_list(blob):
    record(blob)["groups"] = "x"


def _negative_numel(blob):
    record(blob)["groups"][0]["layout"]["numels"][0] = -1


def _short_state(blob):
    state = record(blob)["groups"][0]["state"]
    state["state1"] = state["state1"][:100].clone()


def _names_short(blob):
    record(blob)["groups"][0]["param_names"].pop()


def _step_text(blob):
    record(blob)["groups"][0]["state"]["step"] = "abc"


def _placement_on_plain_group(blob):
    record(blob)["groups"][0]["experts"] = {"group_name": "ep_size_2", "ep_size": 2, "ep_rank": 1, "edp_rank": 0,
                                            "files": [[0], [1]]}


MALFORMED = {"groups_not_a_list": (_groups_not_a_list, "'groups' is str, not list"),
             "negative_numel": (_negative_numel, "is no layout .*numel must be an integer from 1, got -1"),
             "short_state": (_short_state, r"state 'state1' is \(100,\) torch.uint8 in the checkpoint; expected"),
             "names_short": (_names_short, "'param_names' is not a list of .* values"),
             "step_text": (_step_text, "state 'step' should be a number, not abc"),
             "placement_on_plain_group": (_placement_on_plain_group, "the checkpoint mixes files of different runs")}


@pytest.mark.parametrize("case", MALFORMED)
def test_malformed_records_are_named(two_ranks, tmp_path, capsys, case):
    import re
    source, _ = two_ranks
    folder = copy_of(source, tmp_path)
    change, needle = MALFORMED[case]
    rewrite(folder, RANK.format(1), change)
    engine = build_engine(seed=1, min_8bit_size=MIN_8BIT_SIZE)
    before = engine_state(engine)
    with pytest.raises(CheckpointMismatchError, match=needle) as failure:
        engine.load_checkpoint(folder)
    assert RANK.format(1) in str(failure.value) and not differences(engine_state(engine), before)
    for verb, (code, err) in run_verbs(folder, tmp_path, capsys).items():
        assert code == 2 and re.search(needle, err) and RANK.format(1) in err, (verb, err)


def test_subdirectories_in_a_tag(two_ranks, tmp_path, capsys):
    source, _ = two_ranks
    folder = copy_of(source, tmp_path)
    os.makedirs(os.path.join(folder, TAG, "extra"))
    with open(os.path.join(folder, TAG, "extra", "notes.txt"), "w") as f:
        f.write("notes")
    for verb, (code, err) in run_verbs(folder, tmp_path, capsys).items():  # not in the manifest: refused
        assert code == 2 and "extra/notes.txt, which its manifest" in err, (verb, err)
    rehash(folder, os.path.join("extra", "notes.txt"))  # listed: part of the checkpoint, carried along
    out = str(tmp_path / "reshaped")
    assert main(["reshape", folder, out, "--dp", "3", "--quiet"]) == 0
    assert open(os.path.join(out, TAG, "extra", "notes.txt")).read() == "notes"
    build_engine(seed=1, min_8bit_size=MIN_8BIT_SIZE).load_checkpoint(out)


def test_nonsense_values_of_allowed_types_are_refused(two_ranks, tmp_path, capsys):
    source, _ = two_ranks
    folder = copy_of(source, tmp_path)
    rewrite(folder, RANK.format(0), lambda blob: setattr(blob["optimizer_state_dict"]["loss_scaler"], "cur_scale",
                                                         0.0))
    path = os.path.join(folder, TAG, RANK.format(0))
    with torch.serialization.safe_globals(allowed_globals()):  # control: torch's weights-only unpickler takes it
        assert torch.load(path, weights_only=True)["optimizer_state_dict"]["loss_scaler"].cur_scale == 0.0
    needle = "LossScaler with field cur_scale=0.0"
    with pytest.raises(CheckpointMismatchError, match=needle):
        build_engine(seed=1, min_8bit_size=MIN_8BIT_SIZE).load_checkpoint(folder)
    for verb, (code, err) in run_verbs(folder, tmp_path, capsys).items():
        assert code == 2 and needle in err, (verb, err)


def test_convert_to_lamb_then_train(two_ranks, tmp_path):
    source, _ = two_ranks
    out = str(tmp_path / "lamb")
    assert main(["convert", source, out, "--to", "8bit", "--optimizer-class", "bitsandbytes.optim.LAMB8bit",
                 "--min-8bit-size", str(MIN_8BIT_SIZE), "--quiet"]) == 0
    engine = build_engine(bnb.optim.LAMB8bit, seed=1, min_8bit_size=MIN_8BIT_SIZE)
    engine.load_checkpoint(out)
    assert engine.global_steps == 2
    losses = train_steps(engine, range(2, 4))
    assert all(torch.isfinite(torch.tensor(losses)))


def test_failed_runs_leave_nothing_behind(two_ranks, tmp_path, monkeypatch, capsys):
    source, _ = two_ranks
    from deepspeed_bnb.checkpoint.tools import export as export_module
    from deepspeed_bnb.checkpoint.tools import rank_files
    writes = {"n": 0}
    real_save = torch.save

    def failing_second_save(*args, **kwargs):
        writes["n"] += 1
        if writes["n"] == 2:
            raise OSError(28, "No space left on device")
        return real_save(*args, **kwargs)

    monkeypatch.setattr(rank_files.torch, "save", failing_second_save)
    out = str(tmp_path / "reshaped")
    assert main(["reshape", source, out, "--dp", "3", "--quiet"]) == 2
    assert "No space left on device" in capsys.readouterr().err
    assert os.listdir(out) == [], os.listdir(out)  # no staging directory, no latest, no tag
    monkeypatch.setattr(rank_files.torch, "save", real_save)
    real_file = export_module.save_file

    def failing_optimizer_file(tensors, path, metadata=None):
        if "optimizer_class" in (metadata or {}):
            raise OSError(28, "No space left on device")
        return real_file(tensors, path, metadata=metadata)

    monkeypatch.setattr(export_module, "save_file", failing_optimizer_file)
    out = str(tmp_path / "exported")
    assert main(["export", source, out, "--optimizer-state", "--quiet"]) == 2
    assert os.listdir(out) == [], os.listdir(out)  # not even the model file, which was written before the failure


# ---- bounded work ----------------------------------------------------------------------------------------------------

# Runs the tools' main for each argv given (JSON) in a child whose address space may grow by 1 GiB beyond what its
# imports mapped (tests/support/memory_cap.py): prints each exit code and message; an allocation driven by a count in a
# file would end there in MemoryError.
CHILD = r"""
import contextlib, io, json, sys
import torch, safetensors.torch, deepspeed_bnb_tools  # the tools import these on first use: mapped before the cap
from support.memory_cap import cap_above_imports
cap_above_imports(1 << 30)
out = []
for argv in json.loads(sys.argv[1]):
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            code = deepspeed_bnb_tools.main(argv)
        except BaseException as exc:
            code = f"{type(exc).__name__}: {exc}"
    out.append([code, err.getvalue()])
print("RESULT " + json.dumps(out))
"""


def capped(argvs):
    env = {k: v for k, v in os.environ.items() if k != TRUST_ENV}
    done = subprocess.run([sys.executable, "-c", CHILD, json.dumps(argvs)], capture_output=True, text=True,
                          timeout=900, env=env, cwd=TESTS)
    line = [row for row in done.stdout.splitlines() if row.startswith("RESULT ")]
    assert line, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(line[0][len("RESULT "):])


def verb_argvs(folder, tmp_path):
    return [[verb, folder, *[a.format(out=str(tmp_path / f"out_{verb}")) for a in args]]
            for verb, args in VERBS.items()]


@pytest.mark.slow  # fresh processes under a memory cap
def test_a_dp_size_of_a_billion_is_refused(two_ranks, tmp_path):
    source, _ = two_ranks
    folder = copy_of(source, tmp_path)
    rewrite(folder, MODEL, lambda blob: blob.update(dp_world_size=10 ** 9))
    needle = "says the checkpoint was written by 1,000,000,000 data-parallel ranks"
    with pytest.raises(CheckpointMismatchError, match=needle):
        build_engine(seed=1, min_8bit_size=MIN_8BIT_SIZE).load_checkpoint(folder)
    for argv, (code, err) in zip(VERBS, capped(verb_argvs(folder, tmp_path))):
        assert code == 2 and needle in err and MODEL in err, (argv, code, err)


@pytest.mark.slow  # fresh processes under a memory cap
def test_layouts_larger_than_the_files_are_refused(two_ranks, tmp_path):
    source, _ = two_ranks
    folder = copy_of(source, tmp_path)

    def inflate(blob):
        for group in record(blob)["groups"]:
            group["layout"]["numels"] = [n * 10 ** 6 for n in group["layout"]["numels"]]
    for rank in range(2):
        rewrite(folder, RANK.format(rank), inflate)
    claimed = sum(sum(g["layout"]["numels"]) for g in record(torch.load(
        os.path.join(folder, TAG, RANK.format(0)), weights_only=False))["groups"])
    assert claimed > 3 * 10 ** 10  # elements the layouts claim: far beyond the cap, had anything been allocated
    needle = "in the checkpoint; expected"
    for argv, (code, err) in zip(VERBS, capped(verb_argvs(folder, tmp_path))):
        assert code == 2 and needle in err and RANK.format(0) in err, (argv, code, err)
    with pytest.raises(CheckpointMismatchError):
        build_engine(seed=1, min_8bit_size=MIN_8BIT_SIZE).load_checkpoint(folder)


@pytest.mark.slow  # fresh processes under a memory cap
def test_inputs_of_from_bnb_and_convert_are_bounded(two_ranks, tmp_path):
    source, _ = two_ranks
    bomb = hostile_files.zip_bomb(str(tmp_path / "bomb.pt"))
    weights = str(tmp_path / "weights.pt")
    torch.save({"w": torch.zeros(4)}, weights)
    universal = str(tmp_path / "universal")
    assert main(["export", source, universal, "--universal", "--quiet"]) == 0
    results = capped([["convert", bomb, str(tmp_path / "o1"), "--from-bnb", "--weights", weights, "--quiet"],
                      ["convert", universal, str(tmp_path / "o2"), "--to", "8bit", "--dp", "100000", "--quiet"]])
    (code, err), (dp_code, dp_err) = results
    assert code == 2 and "is compressed" in err and bomb in err, err
    assert dp_code == 2 and "--allow-large-dp" in dp_err, dp_err


PLACEMENTS = {  # an expert group's placement as a file might hold it (4 rank files), and the refusal
    "not_a_dict": ([0], "is not a dict with a group name"),
    "negative_rank": ({"ep_rank": -1}, "has counts that are not integers >= 0"),
    "rank_outside": ({"ep_rank": 2}, "names a rank outside its table"),
    "file_twice": ({"files": [[0, 1], [1, 3]]}, "does not split the 4 rank files into 2 equal"),
    "uneven": ({"files": [[0], [1, 2, 3]]}, "does not split the 4 rank files into 2 equal"),
    "file_beyond": ({"files": [[0, 2], [1, 4]]}, "does not split the 4 rank files into 2 equal"),
}


@pytest.mark.parametrize("case", PLACEMENTS)
def test_expert_placement_is_checked(case):
    """A record's expert placement (which rank file holds which experts) is refused by name unless it splits the
    checkpoint's files into equal expert-data-parallel groups. Control: a well-formed one reads back as written."""
    from deepspeed_bnb.checkpoint.format.experts import ExpertPlacement, placement_from_dict
    good = ExpertPlacement("ep_size_2", 2, 1, 0, ((0, 2), (1, 3)))
    assert placement_from_dict(good.to_dict(), 4, "f") == good
    change, needle = PLACEMENTS[case]
    data = change if not isinstance(change, dict) else {**good.to_dict(), **change}
    with pytest.raises(CheckpointMismatchError, match=f"f: the expert placement {needle}"):
        placement_from_dict(data, 4, "f")
