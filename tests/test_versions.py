"""Only the tested DeepSpeed / bitsandbytes releases are accepted at import; the message names the installed release
and the tested ones; setup.py requires the same releases."""

import ast
import json
import os
import subprocess
import sys

import pytest
from packaging.requirements import Requirement

from deepspeed_bnb._versions import ALLOW_UNTESTED_ENV, BITSANDBYTES, DEEPSPEED_RANGE, UnsupportedVersionError, \
    check_versions, is_tested

ACCEPTED = [("deepspeed", "0.16.4"), ("deepspeed", "0.17.3"), ("deepspeed", "0.18.4"), ("deepspeed", "0.18.9"),
            ("deepspeed", "0.19.5"), ("deepspeed", "0.19.7"), ("deepspeed", "0.19.8"), ("deepspeed", "0.19.8+cpu"),
            ("bitsandbytes", "0.49.1"), ("bitsandbytes", "0.49.2"), ("bitsandbytes", "0.50.2"),
            ("bitsandbytes", "0.50.2+cu128")]
REFUSED = [("deepspeed", "0.16.3"), ("deepspeed", "0.15.4"), ("deepspeed", "0.19.8.post1"), ("deepspeed", "0.19.9"),
           ("deepspeed", "0.20.0"), ("deepspeed", "0.20.0rc1"), ("bitsandbytes", "0.48.2"), ("bitsandbytes", "0.49.0"),
           ("bitsandbytes", "0.50.0"), ("bitsandbytes", "0.50.1"), ("bitsandbytes", "0.50.3"),
           ("bitsandbytes", "0.51.0"), ("bitsandbytes", "not-a-version")]


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
              "bitsandbytes": "bitsandbytes 0.49.1, 0.49.2 and 0.50.2 only"}[package]
    assert f"{package} {found} is installed; deepspeed_bnb is tested with {listed}" in message
    assert "pip install 'deepspeed==0.19.8' 'bitsandbytes==0.50.2'" in message and f"{ALLOW_UNTESTED_ENV}=1" in message


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


def setup_requirements() -> dict:
    """setup.py's install_requires, read without running it."""
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "setup.py")
    with open(path) as f:
        tree = ast.parse(f.read())
    requires = next(k.value for node in ast.walk(tree) if isinstance(node, ast.Call)
                    for k in node.keywords if k.arg == "install_requires")
    return {r.name: r for r in map(Requirement, ast.literal_eval(requires))}


@pytest.mark.parametrize("package,found", ACCEPTED + REFUSED[:-1])
def test_setup_requires_exactly_the_tested_releases(package, found):
    assert setup_requirements()[package].specifier.contains(found) == is_tested(package, found)


def test_every_tested_release_is_an_accepted_example():
    """Keeps the examples above in step with the tested releases (a release added there needs its case here)."""
    assert {("bitsandbytes", v) for v in BITSANDBYTES} | {("deepspeed", v) for v in DEEPSPEED_RANGE} <= set(ACCEPTED)


def test_every_release_the_matrix_passed_is_accepted_and_no_other():
    """The guard accepts exactly the DeepSpeed releases of tools/compat_matrix.json whose every claim passed (every
    release in the range), and each bitsandbytes release listed passed in some cell."""
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools", "compat_matrix.json")
    with open(path) as f:
        cells = json.load(f)["cells"]
    good = [c for c in cells if not c.get("install_error") and c["claims"]
            and all(r["outcome"] in ("pass", "n/a") for r in c["claims"].values())]
    passed_deepspeed = {c["deepspeed"] for c in good if c["bitsandbytes"] == BITSANDBYTES[-1]}
    tested_deepspeed = {c["deepspeed"] for c in cells if c["bitsandbytes"] == BITSANDBYTES[-1]}
    assert {v for v in tested_deepspeed if is_tested("deepspeed", v)} == passed_deepspeed
    assert DEEPSPEED_RANGE[0] in passed_deepspeed and DEEPSPEED_RANGE[1] in passed_deepspeed
    assert set(BITSANDBYTES) <= {c["bitsandbytes"] for c in good}


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
    """DeepSpeed 0.19.7 steps ZeRO-1's separate fp32 gradient accumulator unreduced (tests/test_distributed.py shows
    the divergence there): refused on more than one rank, naming the release that fixed it; allowed everywhere else."""
    from deepspeed_bnb.runtime.zero.compat import require_reduced_grad_accum
    if not refused:
        require_reduced_grad_accum(grad_accum, world, deepspeed_version)
        return
    with pytest.raises(NotImplementedError) as failure:
        require_reduced_grad_accum(grad_accum, world, deepspeed_version)
    assert f"DeepSpeed {deepspeed_version} does not average gradients" in str(failure.value)
    assert "fixed in DeepSpeed 0.19.8" in str(failure.value)
