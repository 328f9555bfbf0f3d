"""The first-use check (ops/self_check.py) passes the compiled kernels and catches wrong ones.

- The compiled CPU kernels of every rule of the registry (ops/rules.py) pass it here (and the CUDA kernels wherever a
  GPU is present: the `cuda_kernel` tests run by tests/support/cuda_kernel_run.py).
- Controls, so the check cannot pass vacuously: "kernels" made from the reference with one plausible bug each (one code
  off, the unscale factor ignored, NaN gradients applied as zeros, every segment stepped with the first hyper row, an
  exception such as a build without code for this GPU) are all caught, and the message names what differs.
- On a CPU the kernel's copy of bnb's own 32-bit CPU update (the bnb_cpu arithmetic) is checked against bnb itself;
  the kernel in the ieee arithmetic fails that check (control).
- The ZeRO optimizer steps with bnb's own update, after one warning naming the disagreement, when its kernel fails
  the check (tests/unit/test_routing.py holds the engine-level test).
"""

import pytest
import torch

from deepspeed_bnb.ops import loader, rules, self_check

RULES = tuple(rules.RULES)
KERNEL = loader.load()


def _reference(rule):
    return rules.RULES[rule].reference


def _one_code_off(rule):
    def kernel(*args):
        _reference(rule)(*args)
        args[2][700] ^= 1  # codes1 of the first parameter's tail block
    return kernel


def _without(argument: str, rule):
    """The reference as the kernel, called with `argument` None: a kernel that ignores that argument."""
    def kernel(*args):
        position = rules.argument_names(rule).index(argument)
        _reference(rule)(*args[:position], None, *args[position + 1:])
    return kernel


def _ignores_unscale(rule):
    return _without("inv_scale", rule)


def _nan_as_zero(rule):
    def kernel(params, grads, *rest):
        _reference(rule)(params, torch.nan_to_num(grads, nan=0.0), *rest)
    return kernel


def _first_hyper_row_only(rule):
    """A kernel that reads the hyper row of segment 0 for every segment (a wrong index into the hyper table)."""
    def kernel(*args):
        position = rules.argument_names(rule).index("segments")
        segments = args[position].clone()  # the caller's table stays as it is: the parameters must tell
        segments[:, -1] = segments[0, -1]  # hyper_row, the last column
        _reference(rule)(*args[:position], segments, *args[position + 1:])
    return kernel


def _raises(rule):
    def kernel(*args):
        raise RuntimeError("CUDA error: no kernel image is available for execution on the device")
    return kernel


def _drops_error_terms(rule):
    """A kernel that steps compensated weights as plain bf16 ones (the error terms neither read nor written)."""
    return _without("error", rule)


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("master", ["bf16", "bf16+8"])
def test_master_weight_kinds_are_checked(rule, master):
    """The check runs bf16 and compensated partitions (every master-weight mode the engine has); the reference passes
    them, a kernel that drops the error terms does not (control)."""
    from deepspeed_bnb.optim import master_weights
    assert self_check.MASTERS == master_weights.MODES
    assert self_check.compare(rule, torch.device("cpu"), _reference(rule), master) is None
    if master == "bf16+8":
        problem = self_check.compare(rule, torch.device("cpu"), _drops_error_terms(rule), master)
        assert problem is not None and ("error differs" in problem or "params differs" in problem), problem


@pytest.mark.parametrize("rule", RULES)
def test_control_reference_agrees_with_itself(rule):
    """The harness is not rigged: the reference as the "kernel" passes (so a failure below is the mutation's)."""
    assert self_check.compare(rule, torch.device("cpu"), _reference(rule)) is None


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("mutant, says", [(_one_code_off, "codes1 differs"), (_ignores_unscale, "after step 3"),
                                          (_nan_as_zero, "differs"), (_first_hyper_row_only, "params differs"),
                                          (_raises, "raised RuntimeError: CUDA error: no kernel image")])
def test_wrong_kernels_are_caught(rule, mutant, says):
    problem = self_check.compare(rule, torch.device("cpu"), mutant(rule))
    assert problem is not None and says in problem, problem


def _copy_mutant(rule, spoil):
    """The reference as the kernel, then `spoil(lp_params)`: a copy gone wrong after a right step."""
    def kernel(*args):
        _reference(rule)(*args)
        spoil(args[rules.argument_names(rule).index("lp_params")])
    return kernel


def _stale_copy(rule):
    """A kernel handed the copy that does not write it (what a GPU without the copy's code would leave)."""
    return _without("lp_params", rule)


@pytest.mark.parametrize("rule", RULES)
def test_model_copy_is_checked(rule):
    """With lp_copy the check also holds the model's bf16 copy to torch's conversion of the oracle's weights (segments)
    and to the untouched padding: the reference passes; a copy not written, one element rounded the other way, and a
    written padding element are caught, naming lp_params (controls); the copy needs fp32 master weights."""
    cpu = torch.device("cpu")
    assert self_check.compare(rule, cpu, _reference(rule), lp_copy=True) is None
    padding = self_check.NUMELS[0]  # just after the first parameter (the next one starts at a 256-element boundary)

    def round_other_way(lp):
        lp.view(torch.int16)[3] += 1

    def write_padding(lp):
        lp[padding] = 0.0
    for mutant in (_stale_copy(rule), _copy_mutant(rule, round_other_way), _copy_mutant(rule, write_padding)):
        problem = self_check.compare(rule, cpu, mutant, lp_copy=True)
        assert problem is not None and "lp_params differs from torch's conversion" in problem, problem
    with pytest.raises(ValueError, match="lp_copy.*fp32 master"):
        self_check.compare(rule, cpu, _reference(rule), "bf16", lp_copy=True)


def _passes_on(device):
    for rule in RULES:
        for master in self_check.MASTERS:
            assert self_check.disagreement(rule, device, master) is None, (rule, master)
        # the model's bf16 copy written beside fp32 master weights (runtime/zero/lp_copy.py)
        assert self_check.disagreement(rule, device, "fp32", lp_copy=True) is None, (rule, "lp_copy")


@pytest.mark.skipif(not KERNEL, reason="the C++ kernel could not be built here (see the warning)")
def test_cpu_kernel_passes_self_check():
    _passes_on("cpu")


@pytest.mark.skipif(not KERNEL, reason="the C++ kernel could not be built here (see the warning)")
@pytest.mark.parametrize("rule", RULES)
def test_bnb_cpu_check_holds_the_compiled_kernel_to_bnb_itself(rule):
    """The bnb_cpu check compares the kernel's fp32 segments with bitsandbytes' own 32-bit CPU update (and its 8-bit
    ones with the reference): the compiled kernel passes it for every master-weight mode; the same kernel in the ieee
    arithmetic (every operation rounded on its own) does not (control: the check compares with bnb, not with us)."""
    kernel = rules.get(rule).kernel()
    for master in self_check.MASTERS:
        assert self_check.compare(rule, torch.device("cpu"), kernel, master, rules.BNB_CPU) is None, master

    def ieee(*args):
        position = rules.argument_names(rule).index("arithmetic")
        kernel(*args[:position], rules.IEEE, *args[position + 1:])

    problem = self_check.compare(rule, torch.device("cpu"), ieee, "fp32", rules.BNB_CPU)
    assert problem is not None and "differs from bitsandbytes' own update" in problem, problem


def test_bnb_cpu_check_fails_cleanly_where_bnb_cannot_update(monkeypatch):
    """Where bnb's own CPU update raises (a trimmed or broken install), the bnb_cpu check reports it instead of raising,
    so the engine keeps bnb's update (or the ieee kernel) for 32-bit state."""
    from deepspeed_bnb.ops import bnb_update

    def broken(rule, configs, step):
        def oracle(*args):
            raise OSError("libbitsandbytes_cpu.so: cannot open shared object file (planted)")
        return oracle

    monkeypatch.setattr(bnb_update, "cpu32_oracle", broken)
    problem = self_check.compare("adam", torch.device("cpu"), rules.get("adam").reference, "fp32", rules.BNB_CPU)
    assert problem == "bitsandbytes' own update raised OSError: libbitsandbytes_cpu.so: cannot open shared object " \
                      "file (planted)", problem


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")
def test_cuda_kernel_passes_self_check():
    _passes_on("cuda")


@pytest.mark.skipif(not KERNEL, reason="the C++ kernel could not be built here (see the warning)")
def test_cli_reports_the_check(capsys, monkeypatch):
    """`deepspeed-bnb kernels` says which build runs and passes every rule here (exit 0); a failing rule is printed
    with its difference and makes the exit status 1 (the control)."""
    from deepspeed_bnb import cli
    assert cli.main(["kernels", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "fused kernels: " in out and "build, CPU " in out
    assert all(f"cpu {rule}, {master} master weights: same bits as the reference" in out and
               f"cpu {rule}, {master} master weights, 32-bit state: the kernel, same bits as bitsandbytes' own update"
               in out for rule in RULES for master in self_check.MASTERS), out
    assert all(f"cpu {rule}, the model's bf16 copy: same bits as torch's conversion" in out for rule in RULES), out
    monkeypatch.setattr(self_check, "disagreement", lambda rule, device, master, arithmetic=None, lp_copy=False:
                        "codes1 differs (planted)" if rule == "lion" else
                        "params differs (planted)" if arithmetic == rules.BNB_CPU else
                        "lp_params differs (planted)" if lp_copy and rule == "momentum" else None)
    assert cli.main(["kernels", "--device", "cpu"]) == 1
    out = capsys.readouterr().out
    assert "cpu lion, bf16+8 master weights: FAILS: codes1 differs (planted)" in out
    assert ("cpu adam, fp32 master weights, 32-bit state: bitsandbytes' own update (the kernel's copy of it differs: "
            "params differs (planted))") in out
    assert "cpu momentum, the model's bf16 copy: FAILS: lp_params differs (planted)" in out


@pytest.mark.parametrize("device, says", [("foo", "not a device name"), ("cuda:99", "CUDA GPU(s); use cpu"),
                                          ("meta", "cpu and cuda only")])
def test_cli_refuses_devices_it_cannot_check(device, says, capsys):
    """A device name that is wrong, or a GPU this machine does not see, is an error naming the value and the fix
    (exit 2), not a traceback."""
    from deepspeed_bnb import cli
    assert cli.main(["kernels", "--device", device]) == 2
    err = capsys.readouterr().err
    assert f"--device '{device}'" in err and says in err, err


def test_cli_without_a_build_says_what_steps_instead(capsys, monkeypatch):
    """Without a build, `deepspeed-bnb kernels` says why and what the ZeRO optimizer does then: bitsandbytes' own
    update (route.kernel_route), never the pure-torch reference (exit 1)."""
    from deepspeed_bnb import cli
    from deepspeed_bnb.ops import loader
    monkeypatch.setattr(loader, "load", lambda: False)
    monkeypatch.setitem(loader._state, "error", "RuntimeError: no compiler (planted)")
    assert cli.main(["kernels", "--device", "cpu"]) == 1
    out = capsys.readouterr().out
    assert "not built (RuntimeError: no compiler (planted)); training steps with bitsandbytes' own update" in out
    assert "reference" not in out


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("master", ["fp32", "bf16", "bf16+8"])
def test_bnb_cuda_check_compares_with_bnbs_own_update(rule, master):
    """On a GPU the kernel is checked against bitsandbytes' own update on that GPU (the bnb_cuda arithmetic). Here bnb's
    update is its CPU path, standing in for the kernel: the check's plumbing (rows, bf16 gradients for bf16 and
    compensated weights, the oracle's arguments) passes it, and one wrong code in it is caught (control)."""
    oracle = rules.get(rule).oracle(rules.BNB_CUDA)
    assert self_check.compare(rule, torch.device("cpu"), oracle, master, rules.BNB_CUDA) is None

    def one_code_off(*args):
        oracle(*args)
        args[2][700] ^= 1

    problem = self_check.compare(rule, torch.device("cpu"), one_code_off, master, rules.BNB_CUDA)
    assert problem is not None and "differs from bitsandbytes' own update" in problem, problem

