"""The rule registry (ops/rules.py) agrees with every other place a fused update rule lives.

- Every rule's field checks cover exactly the get_config fields the contract knows (ops/rule_fields.py).
- From the sources, without a build: csrc/ops.cpp defines exactly the registry's operators, each with the argument
  names rules.argument_names gives (the reference's signature has them too); every operator has a CPU implementation
  among build_flags.CPU_SOURCES and a CUDA one among CUDA_SOURCES.
- Loaded: each operator's schema has those arguments, it has a fake implementation registered by ops/fake.py (looked
  up in torch's registry: torch traces an in-place operator that returns nothing even without one, so opcheck alone
  would not tell; control: a name without one looks up as none), and torch.library.opcheck passes its schema and
  fake tensors on the first-use check's partition; every rule passes the first-use check (ops/self_check.py) here.
- rules.step_ raises when the kernels cannot be loaded rather than running the reference (control: the reference
  itself does change the parameters), and refuses tensors for the wrong number of moments.
"""

import inspect
import os
import re

import pytest
import torch

from deepspeed_bnb.ops import build_flags, loader, rules, self_check
from deepspeed_bnb.ops import rule_fields
from conftest import ROOT

KERNEL = loader.load()
needs_kernel = pytest.mark.skipif(not KERNEL, reason="the C++ kernel could not be built here (see the warning)")


def _source(path: str) -> str:
    with open(os.path.join(ROOT, path)) as f:
        return re.sub(r"//[^\n]*", "", f.read())  # without comments, which name operators too


def _schemas() -> dict:
    """operator -> its argument names, from the m.def(...) lines of csrc/ops.cpp (adjacent string literals joined)."""
    schemas = {}
    for literals in re.findall(r"m\.def\(((?:\s*\"[^\"]*\")+)\s*\)", _source("csrc/ops.cpp")):
        schema = "".join(re.findall(r'"([^"]*)"', literals))
        name, arguments = re.fullmatch(r"(\w+)\((.*)\)\s*->.*", schema).groups()
        schemas[name] = tuple(argument.split()[-1].split("=")[0] for argument in arguments.split(","))  # no default
    return schemas


def _implemented(sources, dispatch_key: str) -> set:
    """The operators that TORCH_LIBRARY_IMPL(deepspeed_bnb, <dispatch_key>, m) blocks of `sources` implement."""
    found = set()
    for path in sources:
        for body in re.findall(r"TORCH_LIBRARY_IMPL\(deepspeed_bnb,\s*" + dispatch_key + r",\s*m\)\s*\{([^}]*)\}",
                               _source(path)):
            found |= set(re.findall(r'm\.impl\("(\w+)"', body))
    return found


def test_every_rule_checks_exactly_the_known_fields():
    for name, rule in rules.RULES.items():
        assert name == rule.name
        assert set(rule.fields) == set(rule_fields.FIELDS + rule_fields.LEGACY_FIELDS), name


def test_ops_cpp_defines_the_registry_operators_with_its_arguments():
    schemas = _schemas()
    assert set(schemas) == set(rules.OPERATORS)
    assert rules.OPERATORS == build_flags.OPERATORS  # what the loader checks a build for
    for rule in rules.RULES.values():
        assert schemas[rule.operator] == rules.argument_names(rule), rule.name
        assert tuple(inspect.signature(rule.reference).parameters) == rules.argument_names(rule), rule.name
    # control: the names differ between a two-moment and a one-moment rule, so the comparison is not vacuous
    assert rules.argument_names("adam") != rules.argument_names("lion")


@pytest.mark.parametrize("dispatch_key, sources", [("CPU", build_flags.CPU_SOURCES),
                                                   ("CUDA", build_flags.CUDA_SOURCES)])
def test_every_operator_has_cpu_and_cuda_implementations(dispatch_key, sources):
    assert _implemented(sources, dispatch_key) == set(rules.OPERATORS)


def test_row_builders_give_the_rule_row_class():
    config = self_check.CONFIGS[0]
    for rule in rules.RULES.values():
        row = rule.row(config, 1)
        assert type(row) is rule.hyper and len(row.row()) == rule.hyper.FIELDS, rule.name


def _self_check_arguments(rule: str) -> tuple:
    tensors = self_check._partition(rule, torch.device("cpu"))
    grads = self_check._gradients(tensors["params"].numel(), 1, torch.Generator().manual_seed(0))
    return self_check._arguments(rule, tensors, grads, self_check._hyper(rule, 1), 1.0)


def _fake_source(operator: str):
    """Where the fake implementation of deepspeed_bnb::<operator> was registered, or None."""
    from torch._library.simple_registry import singleton
    kernel = singleton.find(f"deepspeed_bnb::{operator}").fake_impl.kernel
    return None if kernel is None else kernel.source


@needs_kernel
@pytest.mark.parametrize("rule", list(rules.RULES))
def test_loaded_operator_schema_and_fake_implementation(rule):
    operator = getattr(torch.ops.deepspeed_bnb, rules.RULES[rule].operator).default
    assert tuple(argument.name for argument in operator._schema.arguments) == rules.argument_names(rule)
    assert os.path.join("deepspeed_bnb", "ops", "fake.py") in (_fake_source(rules.RULES[rule].operator) or "")
    assert _fake_source("no_such_step_") is None  # control: the look-up can come back empty
    torch.library.opcheck(operator, _self_check_arguments(rule), test_utils=("test_schema", "test_faketensor"))


@needs_kernel
@pytest.mark.parametrize("rule", list(rules.RULES))
def test_every_rule_passes_its_first_use_check(rule):
    assert self_check.disagreement(rule, "cpu") is None


def test_step_without_kernels_raises_instead_of_running_the_reference(monkeypatch):
    args = _self_check_arguments("lion")
    before = args[0].clone()
    monkeypatch.setattr(loader, "load", lambda: False)
    monkeypatch.setitem(loader._state, "error", "RuntimeError: no compiler (planted)")
    with pytest.raises(RuntimeError, match=re.escape("could not be built or loaded here: RuntimeError: no compiler")):
        rules.step_("lion", args[0], args[1], [args[2]], [args[3]], [args[4]], [args[5]], *args[6:])
    assert torch.equal(args[0], before)
    rules.step_("lion", args[0], args[1], [args[2]], [args[3]], [args[4]], [args[5]], *args[6:], use_kernel=False)
    assert not torch.equal(args[0], before), "control: the reference does step these parameters"


def test_wrong_moment_count_and_unknown_rule_are_refused():
    params = torch.zeros(256)
    with pytest.raises(ValueError, match="'adam' rule keeps 2 moment\\(s\\): codes needs 2 tensor\\(s\\), got 1"):
        rules.step_("adam", params, params, [params], [params], [params, params], [params, params], params, params)
    with pytest.raises(ValueError, match="'rmsprop' update rule \\(the fused rules are adam, lion, momentum\\)"):
        rules.get("rmsprop")


def test_every_rule_has_bnb_param_groups_for_its_gpu_tests():
    """tests/kernels/test_fused_bnb_cuda.py holds every rule's bnb_cuda kernel to bnb on a GPU from its CONFIGS."""
    from support.kernel_harness import BNB_CUDA_CONFIGS as CONFIGS
    assert set(CONFIGS) == set(rules.RULES)
    assert all(len(configs) == 3 for configs in CONFIGS.values())  # one per hyper row of the partitions
