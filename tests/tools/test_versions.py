"""Only the tested DeepSpeed / bitsandbytes / torch releases are accepted at import; the message names the installed
release and the tested ones; setup.py requires the same releases; a torch below the floor is refused even with the
opt-in (no checkpoint would load), offline tools included; a DeepSpeed built from a git checkout is no release."""

import ast
import json
import os
import re
import subprocess
import sys

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

from deepspeed_bnb._versions import ALLOW_UNTESTED_ENV, BITSANDBYTES, DEEPSPEED_RANGE, TORCH, UnsupportedVersionError, \
    check_versions, is_tested, require_torch_floor
from conftest import ROOT

ACCEPTED = [("deepspeed", "0.16.4"), ("deepspeed", "0.17.3"), ("deepspeed", "0.18.4"), ("deepspeed", "0.18.9"),
            ("deepspeed", "0.19.5"), ("deepspeed", "0.19.7"), ("deepspeed", "0.19.8"), ("deepspeed", "0.19.8+cpu"),
            ("bitsandbytes", "0.49.1"), ("bitsandbytes", "0.49.2"), ("bitsandbytes", "0.50.2"),
            ("bitsandbytes", "0.50.2+cu128"), ("torch", "2.6.0"), ("torch", "2.7.1"), ("torch", "2.8.0"),
            ("torch", "2.9.1"), ("torch", "2.10.0"), ("torch", "2.11.0"), ("torch", "2.12.1"), ("torch", "2.13.0+cpu"),
            ("torch", "2.14.1"), ("torch", "2.15.0")]
REFUSED = [("deepspeed", "0.16.3"), ("deepspeed", "0.15.4"), ("deepspeed", "0.19.8.post1"), ("deepspeed", "0.19.9"),
           ("deepspeed", "0.20.0"), ("deepspeed", "0.20.0rc1"), ("bitsandbytes", "0.48.2"), ("bitsandbytes", "0.49.0"),
           ("bitsandbytes", "0.50.0"), ("bitsandbytes", "0.50.1"), ("bitsandbytes", "0.50.3"),
           ("bitsandbytes", "0.51.0"), ("torch", "2.16.0"), ("torch", "2.17.1"), ("bitsandbytes", "not-a-version")]
SOURCE_BUILDS = ["0.19.6+edaa72212", "0.19.9+g1a2b3c4"]  # DeepSpeed's setup.py appends the commit to version.txt
BELOW_FLOOR = ["2.4.1", "2.5.1", "2.5.1+cu124"]


def test_installed_versions_pass():
    check_versions()


@pytest.mark.parametrize("package,found", ACCEPTED)
def test_tested_release_is_accepted(package, found, monkeypatch):
    monkeypatch.delenv(ALLOW_UNTESTED_ENV, raising=False)
    check_versions({package: found})


@pytest.mark.parametrize("package,found", REFUSED)
def test_untested_release_is_refused_naming_it_and_the_tested_ones(package, found, monkeypatch):
    monkeypatch.delenv(ALLOW_UNTESTED_ENV, raising=False)
    with pytest.raises(UnsupportedVersionError) as failure:
        check_versions({package: found})
    message = str(failure.value)
    listed = {"deepspeed": "deepspeed 0.16.4 to 0.19.8 only",
              "bitsandbytes": "bitsandbytes 0.49.1, 0.49.2 and 0.50.2 only",
              "torch": "torch 2.6, 2.7, 2.8, 2.9, 2.10, 2.11, 2.12, 2.13, 2.14 and 2.15 only"}[package]
    assert f"{package} {found} is installed; deepspeed_bnb is tested with {listed}" in message
    fix = {"torch": "pip install 'torch==2.13.*'"}.get(package,
                                                        "pip install 'deepspeed==0.19.8' 'bitsandbytes==0.50.2'")
    assert fix in message and f"{ALLOW_UNTESTED_ENV}=1" in message


@pytest.mark.parametrize("found", SOURCE_BUILDS)
def test_deepspeed_built_from_source_is_no_release(found, monkeypatch):
    """Its number is the next release's (or the last one's), so it is refused as a build, naming the commit; a local
    label that is not a commit (a vendor's +cpu) still counts as its release."""
    monkeypatch.delenv(ALLOW_UNTESTED_ENV, raising=False)
    with pytest.raises(UnsupportedVersionError, match=rf"deepspeed {re.escape(found)} is installed, a build of "
                                                      rf"deepspeed's source at commit {found.split('+')[1]} "
                                                      r"\(not a release\)"):
        check_versions({"deepspeed": found})
    assert is_tested("deepspeed", "0.19.6") and not is_tested("deepspeed", found)
    monkeypatch.setenv(ALLOW_UNTESTED_ENV, "1")
    with pytest.warns(RuntimeWarning, match="a build of deepspeed's source"):
        check_versions({"deepspeed": found})


@pytest.mark.parametrize("found", BELOW_FLOOR)
def test_torch_below_the_floor_is_refused_even_with_the_opt_in(found, monkeypatch):
    monkeypatch.setenv(ALLOW_UNTESTED_ENV, "1")
    with pytest.raises(UnsupportedVersionError, match=rf"torch {re.escape(found)} is installed; deepspeed_bnb needs "
                                                      r"torch 2.6 or later, because it loads checkpoints"):
        check_versions({"torch": found})
    with pytest.raises(UnsupportedVersionError, match="safe_globals in 2.5"):
        require_torch_floor(found)
    require_torch_floor("2.6.0")  # control: the floor itself passes


def test_offline_tools_refuse_a_torch_below_the_floor_too():
    """The offline import skips the release check but not the floor: torch's own error would blame the file."""
    code = ("import importlib.metadata as m; real = m.version\n"
            "m.version = lambda p: '2.5.1' if p == 'torch' else real(p)\n"
            "import deepspeed_bnb")
    env = {k: v for k, v in os.environ.items() if k != ALLOW_UNTESTED_ENV}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**env, "DEEPSPEED_BNB_OFFLINE": "1"})
    assert done.returncode != 0 and "torch 2.5.1 is installed; deepspeed_bnb needs torch 2.6 or later" in done.stderr
    control = subprocess.run([sys.executable, "-c", code.replace("'2.5.1'", "'2.6.0'")], capture_output=True,
                             text=True, env={**env, "DEEPSPEED_BNB_OFFLINE": "1"})
    assert control.returncode == 0, control.stderr


def test_escape_hatch_warns_instead(monkeypatch):
    monkeypatch.setenv(ALLOW_UNTESTED_ENV, "1")
    with pytest.warns(RuntimeWarning, match="deepspeed 0.20.0 is installed"):
        check_versions({"deepspeed": "0.20.0"})


def test_import_fails_on_untested_version():
    """The check runs at import: a fake distribution metadata version makes `import deepspeed_bnb` fail."""
    code = ("import importlib.metadata as m; real = m.version\n"
            "m.version = lambda p: '0.16.0' if p == 'deepspeed' else real(p)\n"
            "import deepspeed_bnb")
    env = {k: v for k, v in os.environ.items() if k != ALLOW_UNTESTED_ENV}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert done.returncode != 0 and "deepspeed 0.16.0 is installed; deepspeed_bnb is tested with" in done.stderr


def setup_keyword(name: str):
    """A keyword of setup.py's setup() call, read without running it."""
    with open(os.path.join(ROOT, "setup.py")) as f:
        tree = ast.parse(f.read())
    return ast.literal_eval(next(k.value for node in ast.walk(tree) if isinstance(node, ast.Call)
                                 for k in node.keywords if k.arg == name))


def setup_requirements() -> dict:
    """setup.py's install_requires."""
    return {r.name: r for r in map(Requirement, setup_keyword("install_requires"))}


def matrix_cells() -> list:
    with open(os.path.join(ROOT, "tools", "compat_matrix.json")) as f:
        return json.load(f)["cells"]


def passed(cell: dict) -> bool:
    return (not cell.get("install_error") and bool(cell["claims"])
            and all(r["outcome"] in ("pass", "n/a") for r in cell["claims"].values()))


@pytest.mark.parametrize("package,found", ACCEPTED + REFUSED[:-1])
def test_setup_requires_exactly_the_tested_releases(package, found):
    assert setup_requirements()[package].specifier.contains(found) == is_tested(package, found)


def test_every_tested_release_is_an_accepted_example():
    """Keeps the examples above in step with the tested releases (a release added there needs its case here)."""
    assert {("bitsandbytes", v) for v in BITSANDBYTES} | {("deepspeed", v) for v in DEEPSPEED_RANGE} <= set(ACCEPTED)
    assert set(TORCH) == {".".join(v.split(".")[:2]) for p, v in ACCEPTED if p == "torch"}


def test_python_requires_starts_at_the_oldest_python_the_matrix_passed_on():
    pythons = {c.get("python", "3.11") for c in matrix_cells() if passed(c)}
    oldest = min(pythons, key=lambda v: tuple(map(int, v.split("."))))
    assert setup_keyword("python_requires") == f">={oldest}" and len(pythons) >= 2


def test_every_release_the_matrix_passed_is_accepted_and_no_other():
    """The guard accepts exactly the DeepSpeed releases of tools/compat_matrix.json whose every claim passed (every
    release in the range), and each bitsandbytes release listed passed in some cell."""
    cells = [{"torch": "2.13.0", **c} for c in matrix_cells()]  # cells from before the torch axis ran on 2.13.0
    good = [c for c in cells if passed(c)]
    python = SpecifierSet(setup_keyword("python_requires"))
    accepted = [c for c in cells if all(is_tested(p, c[p]) for p in ("deepspeed", "bitsandbytes", "torch"))
                and python.contains(c.get("python", "3.11"))]
    assert [c for c in accepted if not passed(c)] == []  # nothing the guard accepts failed anywhere
    passed_deepspeed = {c["deepspeed"] for c in good if c["bitsandbytes"] == BITSANDBYTES[-1]}
    assert {c["deepspeed"] for c in good if is_tested("deepspeed", c["deepspeed"])} == passed_deepspeed
    assert DEEPSPEED_RANGE[0] in passed_deepspeed and DEEPSPEED_RANGE[1] in passed_deepspeed
    assert set(BITSANDBYTES) <= {c["bitsandbytes"] for c in good}
    assert set(TORCH) == {".".join(c["torch"].split(".")[:2]) for c in good}


def test_padding_mode_follows_the_release_and_the_environment(monkeypatch):
    """DeepSpeed < 0.19.7 has no `param_padding` in flatten_dense_tensors_aligned: the block-aligned layout is then
    placed with padding tensors; DEEPSPEED_BNB_ZERO_PADDING picks either where both exist, and naming per-parameter
    padding on a release without it is refused, naming the release that added it."""
    from deepspeed_bnb.runtime.zero.compat import PADDING_ENV, PADDING_TENSORS, PARAM_PADDING, has_parameter_padding, \
        padding_mode

    class ZeroBefore0197:  # the signature DeepSpeed 0.19.6 and earlier have
        def flatten_dense_tensors_aligned(self, tensor_list, alignment, use_cpu_data=False):
            pass

    monkeypatch.delenv(PADDING_ENV, raising=False)
    assert padding_mode() == (PARAM_PADDING if has_parameter_padding() else PADDING_TENSORS)
    assert not has_parameter_padding(ZeroBefore0197) and padding_mode(ZeroBefore0197) == PADDING_TENSORS
    monkeypatch.setenv(PADDING_ENV, PADDING_TENSORS)
    assert padding_mode() == PADDING_TENSORS
    monkeypatch.setenv(PADDING_ENV, PARAM_PADDING)
    with pytest.raises(ValueError, match="has no per-parameter padding in ZeRO-1/2 flat groups \\(added in 0.19.7\\)"):
        padding_mode(ZeroBefore0197)
    monkeypatch.setenv(PADDING_ENV, "sometimes")
    with pytest.raises(ValueError, match="DEEPSPEED_BNB_ZERO_PADDING='sometimes'"):
        padding_mode()


def test_flattening_with_autograd_is_recognised_from_the_source():
    """DeepSpeed 0.18.7-0.18.9's ZeRO-1/2 __init__ decides `flatten_on_gpu` (and then flattens the parameters
    themselves); the installed release is told apart by its source, not its number."""
    from deepspeed_bnb.runtime.zero.compat import flattens_with_autograd

    class Zero0189:  # the decision those releases make
        def __init__(self, accelerator, flat_buffer_bytes):
            flatten_on_gpu = accelerator.is_available() and accelerator.available_memory() >= flat_buffer_bytes
            self.flat = flatten_on_gpu

    class Zero0190:
        def __init__(self):
            self.flat = None

    assert flattens_with_autograd(Zero0189) and not flattens_with_autograd(Zero0190)
    import deepspeed
    assert flattens_with_autograd() == (deepspeed.__version__.split("+")[0] in ("0.18.7", "0.18.8", "0.18.9"))


@pytest.mark.parametrize("deepspeed_version,grad_accum,world,refused", [
    ("0.19.7", True, 2, True), ("0.19.7+cpu", True, 3, True),
    ("0.19.7", True, 1, False), ("0.19.7", False, 2, False), ("0.19.8", True, 2, False)])
def test_zero1_fp32_grad_accum_refused_where_deepspeed_does_not_average_it(deepspeed_version, grad_accum, world,
                                                                           refused):
    """DeepSpeed 0.19.7 steps ZeRO-1's separate fp32 gradient accumulator unreduced
    (tests/distributed/test_distributed.py shows the divergence there): refused on more than one rank, naming the
    release that fixed it; allowed everywhere else."""
    from deepspeed_bnb.runtime.zero.compat import require_reduced_grad_accum
    if not refused:
        require_reduced_grad_accum(grad_accum, world, deepspeed_version)
        return
    with pytest.raises(NotImplementedError) as failure:
        require_reduced_grad_accum(grad_accum, world, deepspeed_version)
    assert f"DeepSpeed {deepspeed_version} does not average gradients" in str(failure.value)
    assert "fixed in DeepSpeed 0.19.8" in str(failure.value)


def test_moe_model_states_get_param_shapes_where_deepspeed_leaves_them_out():
    """DeepSpeed before 0.19.3 writes an MoE model's model states without `param_shapes`: the checkpoint engine's save
    gets them added (the value `_save_checkpoint` writes); everything else passes through untouched."""
    from deepspeed_bnb.runtime.zero.compat import with_moe_param_shapes

    class Engine:
        has_moe_layers = True

        def _get_zero_param_shapes(self):
            return [{"w": (4, 4)}]

    written = []
    save = with_moe_param_shapes(Engine(), lambda state, path: written.append((path, state)))
    save({"module": {}}, "model_states.pt")
    save({"module": {}, "param_shapes": ["theirs"]}, "model_states.pt")
    save({"w": 1}, "expert.pt")  # an expert file: no model states
    plain = Engine()
    plain.has_moe_layers = False
    with_moe_param_shapes(plain, lambda state, path: written.append((path, state)))({"module": {}}, "model.pt")
    assert [state for _, state in written] == [{"module": {}, "param_shapes": [{"w": (4, 4)}]},
                                               {"module": {}, "param_shapes": ["theirs"]}, {"w": 1}, {"module": {}}]


def test_zero3_partition_group_and_rank_fall_back_to_the_dp_group(one_rank):
    """Before DeepSpeed 0.19.3 a ZeRO-3 optimizer has no per-parameter partition groups: a parameter's slices are
    spread over the data-parallel group, this rank's slice is its rank there; where the methods exist they decide."""
    from deepspeed_bnb.runtime.zero.compat import param_partition_group, param_partition_rank
    group = one_rank.new_group(ranks=[0])

    class Before0193:
        dp_process_group = group

    class From0193(Before0193):
        def _get_param_partition_group(self, param):
            return ("expert group of", param)

        def _get_param_partition_rank(self, param):
            return 7

    assert param_partition_group(Before0193(), "p") is group and param_partition_rank(Before0193(), "p") == 0
    assert param_partition_group(From0193(), "p") == ("expert group of", "p") and param_partition_rank(From0193(),
                                                                                                      "p") == 7
