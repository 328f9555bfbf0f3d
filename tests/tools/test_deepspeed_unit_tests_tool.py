"""tools/deepspeed_unit_tests.py's pieces that decide what DeepSpeed's own tests check when run with a bnb client:
the optimizer replacement (its sitecustomize) and the nested state comparison.

- A configured Adam and a client torch Adam/AdamW become bitsandbytes' AdamW8bit with the same groups and
  hyper-parameters, the config losing its "optimizer" entry; anything else is left alone (control).
- The comparison descends into bnb 0.50's nested '__bnb_optimizer_quant_state__': equal nested states pass, one
  changed code fails. Control: a flat comparison in DeepSpeed's manner cannot compare them at all.
- An interpreter whose pytest is 8.4 or later (or that has none) is refused before any run, naming the fix.
"""

import importlib.util
import os

import bitsandbytes as bnb
import pytest
import torch

from conftest import ROOT

SITE = os.path.join(ROOT, "tools", "deepspeed_unit_tests_site", "sitecustomize.py")


@pytest.fixture(scope="module")
def site():
    spec = importlib.util.spec_from_file_location("dsbnb_unit_site", SITE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # no DEEPSPEED_BNB_UNIT_MODE here: it installs nothing
    return module


def flat_compare(state0, state1, expected_mismatch_keys=[]):
    """A flat comparison as DeepSpeed's checkpoint tests make it: tensors with torch.equal, the rest with ==."""
    assert set(state0) - set(expected_mismatch_keys) == set(state1) - set(expected_mismatch_keys)
    for k in set(state0) - set(expected_mismatch_keys):
        if torch.is_tensor(state0[k]):
            assert torch.equal(state0[k], state1[k])
        else:
            assert state0[k] == state1[k]


def bnb_state(code: int = 5) -> dict:
    codes = torch.full((256,), code, dtype=torch.uint8)
    return {"step": 3, "__bnb_optimizer_quant_state__": {"state1": codes, "absmax1": torch.ones(1)}}


def test_nested_comparison_sees_bnb_state(site):
    compare = site._compare_nested(flat_compare)
    compare(bnb_state(), bnb_state())
    with pytest.raises(AssertionError):
        compare(bnb_state(), bnb_state(code=6))
    with pytest.raises(RuntimeError, match="ambiguous"):  # control: the flat comparison cannot compare them
        flat_compare(bnb_state(), bnb_state())


def test_adam_becomes_adamw8bit_with_the_same_settings(site):
    model = torch.nn.Linear(4, 4)
    config = {"optimizer": {"type": "Adam", "params": {"lr": 0.1, "betas": [0.8, 0.9], "weight_decay": 0.01}},
              "train_batch_size": 2}
    kwargs = site._bnb_optimizer({"model": model, "config": config, "model_parameters": model.parameters()})
    optimizer = kwargs["optimizer"]
    assert isinstance(optimizer, bnb.optim.AdamW8bit) and "optimizer" not in kwargs["config"]
    assert config["optimizer"]["type"] == "Adam"  # the test's own dict is left as it was
    group = optimizer.param_groups[0]
    assert (group["lr"], group["betas"], group["weight_decay"]) == (0.1, (0.8, 0.9), 0.01)
    client = torch.optim.AdamW(model.parameters(), lr=0.2, eps=1e-6)
    kwargs = site._bnb_optimizer({"model": model, "optimizer": client, "config": {"train_batch_size": 2}})
    group = kwargs["optimizer"].param_groups[0]
    assert isinstance(kwargs["optimizer"], bnb.optim.AdamW8bit) and (group["lr"], group["eps"]) == (0.2, 1e-6)
    assert group["params"] == client.param_groups[0]["params"]
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)  # control: not an Adam, left alone
    assert site._bnb_optimizer({"model": model, "optimizer": sgd, "config": {}})["optimizer"] is sgd


@pytest.mark.parametrize("prints,needle", [("9.0.1", "has pytest 9.0.1; DeepSpeed's unit tests need pytest < 8.4"),
                                           ("", "does not run pytest")])
def test_an_interpreter_without_pytest_before_8_4_is_refused_up_front(tmp_path, prints, needle):
    """DeepSpeed's DistributedTest harness needs pytest < 8.4: the tool names the interpreter and the fix before any
    run (a stand-in interpreter that answers the version question; control: one answering 8.3.5 gets past the check
    to the tests folder's)."""
    import subprocess
    import sys

    def tool(answer):
        fake = tmp_path / f"python_{answer or 'none'}"
        fake.write_text(f"#!/bin/sh\necho {answer}\n")
        fake.chmod(0o755)
        return subprocess.run([sys.executable, os.path.join(ROOT, "tools", "deepspeed_unit_tests.py"), "--tests",
                               str(tmp_path), "--python", str(fake), "--out", str(tmp_path / "r.md"), "some::id"],
                              capture_output=True, text=True)

    refused = tool(prints)
    assert refused.returncode != 0 and needle in refused.stderr, refused.stderr
    passed = tool("8.3.5")
    assert passed.returncode != 0 and "has no unit/ folder" in passed.stderr, passed.stderr
