"""Under `deepspeed-bnb run`, a training framework release the suite has not run is said once, by name, with the
tested ones (deepspeed_bnb/launch/frameworks.py); a tested one, a process running no framework, and a process that
did not ask for deepspeed_bnb say nothing.

Oracle: the installed releases as importlib.metadata reports them (stubbed per case for frameworks not installed
here), and the engine's log of one real deepspeed.initialize on one CPU rank.
"""

import logging
import sys

import bitsandbytes as bnb
import deepspeed
import pytest

from deepspeed_bnb.launch import RUN_ENV, frameworks
from deepspeed_bnb.runtime import engine as bnb_engine
from support.toy import ds_config, make_model, param_groups


@pytest.fixture
def installed(monkeypatch):
    """Stub the installed releases: {distribution: release}; a distribution not in it is not installed."""
    releases = {}

    def version(distribution):
        if distribution not in releases:
            raise frameworks.PackageNotFoundError(distribution)
        return releases[distribution]

    monkeypatch.setattr(frameworks, "version", version)
    return releases


def test_a_tested_release_says_nothing_and_an_untested_one_is_named_with_the_tested(installed):
    installed.update(trl=frameworks.TESTED["trl"][1][0])
    assert frameworks.untested_release({"trl": object()}) is None
    installed.update(trl="0.1.0")
    said = frameworks.untested_release({"trl": object()})
    assert said.startswith("deepspeed-bnb run: trl 0.1.0 has not been tested with deepspeed_bnb (tested: ")
    assert frameworks.TESTED["trl"][1][0] in said


def test_the_framework_is_the_first_imported_and_its_libraries_are_not_judged(installed):
    # LLaMA-Factory imports an older TRL than the one whose command line was tested: that TRL is not the framework
    installed.update(llamafactory="0.9.5", trl="0.24.0")
    assert frameworks.running({"llamafactory": 1, "trl": 1}) == ("llamafactory", "0.9.5")
    assert frameworks.untested_release({"llamafactory": 1, "trl": 1}) is None
    installed.update(axolotl="0.99.0")
    assert "axolotl 0.99.0 has not been tested" in frameworks.untested_release({"axolotl": 1, "trl": 1})


def test_no_framework_or_no_release_to_compare_says_nothing(installed):
    assert frameworks.untested_release({"torch": 1}) is None  # a script of its own
    assert frameworks.untested_release({"trl": 1}) is None  # imported from a source folder: not installed


def _routed_log(caplog, monkeypatch, run_env):
    """The DeepSpeed log lines of one engine built for AdamW8bit with `RUN_ENV` = `run_env` (None: unset)."""
    monkeypatch.setattr(bnb_engine, "_said", set())
    if run_env is None:
        monkeypatch.delenv(RUN_ENV, raising=False)
    else:
        monkeypatch.setenv(RUN_ENV, run_env)
    logger = logging.getLogger("DeepSpeed")
    logger.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.WARNING, logger="DeepSpeed"):
            model = make_model(0)
            deepspeed.initialize(model=model, optimizer=bnb.optim.AdamW8bit(param_groups(model), lr=1e-3),
                                 config=ds_config(1, stage=2))
    finally:
        logger.removeHandler(caplog.handler)
    return [r.getMessage() for r in caplog.records]


def test_a_wrapped_engine_says_the_untested_release_once_and_an_unwrapped_one_never(one_rank, installed,
                                                                                    monkeypatch, caplog):
    installed.update(trl="0.1.0")
    monkeypatch.setitem(sys.modules, "trl", object())
    lines = _routed_log(caplog, monkeypatch, "1")
    assert sum("trl 0.1.0 has not been tested" in line for line in lines) == 1, lines
    assert sum("deepspeed_bnb's BnbZeroOptimizer steps" in line for line in lines) == 1, lines
    caplog.clear()
    lines = _routed_log(caplog, monkeypatch, None)  # control: the same process, not under the wrapper
    assert not any("deepspeed-bnb run" in line for line in lines), lines
