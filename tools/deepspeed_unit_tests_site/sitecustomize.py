"""Put on PYTHONPATH by tools/deepspeed_unit_tests.py: in the processes of a DeepSpeed unit test (its pytest and the
workers DeepSpeed's DistributedTest spawns), wraps deepspeed.initialize so that every engine is logged, and in the
bnb mode every Adam/AdamW the test configures becomes bitsandbytes' AdamW8bit with deepspeed_bnb imported. In both
modes the checkpoint tests' state comparison descends into nested dicts (see _compare_nested).

DEEPSPEED_BNB_UNIT_MODE: "stock" (DeepSpeed as the test wrote it) or "bnb"; DEEPSPEED_BNB_UNIT_LOG: a file that gets
one JSON line per engine (the mode, the ZeRO optimizer's class and the base optimizer's). Nothing happens without them.
"""

import json
import os

MODE = os.environ.get("DEEPSPEED_BNB_UNIT_MODE")
ADAM_TYPES = ("adam", "adamw")


def _hyper(group_or_params: dict) -> dict:
    betas = tuple(group_or_params.get("betas", (0.9, 0.999)))
    return {"lr": group_or_params.get("lr", 1e-3), "betas": betas, "eps": group_or_params.get("eps", 1e-8),
            "weight_decay": group_or_params.get("weight_decay", 0.0)}


def _bnb_optimizer(kwargs: dict) -> dict:
    """kwargs of deepspeed.initialize with a configured or client Adam/AdamW replaced by AdamW8bit."""
    import bitsandbytes as bnb
    import torch
    client = kwargs.get("optimizer")
    config = kwargs.get("config") if isinstance(kwargs.get("config"), dict) else kwargs.get("config_params")
    if isinstance(client, (torch.optim.Adam, torch.optim.AdamW)):
        groups = [{"params": g["params"], **_hyper(g)} for g in client.param_groups]
        kwargs["optimizer"] = bnb.optim.AdamW8bit(groups, min_8bit_size=0)
    elif client is None and isinstance(config, dict) and \
            str(config.get("optimizer", {}).get("type", "")).lower() in ADAM_TYPES:
        config = dict(config)
        params = kwargs.get("model_parameters")
        params = list(params) if params is not None else list(kwargs["model"].parameters())
        kwargs["optimizer"] = bnb.optim.AdamW8bit(params, min_8bit_size=0,
                                                  **_hyper(config.pop("optimizer").get("params", {})))
        kwargs["config" if isinstance(kwargs.get("config"), dict) else "config_params"] = config
    return kwargs


def _log(engine) -> None:
    optimizer = getattr(engine, "optimizer", None)
    base = getattr(optimizer, "optimizer", None)
    with open(os.environ["DEEPSPEED_BNB_UNIT_LOG"], "a") as f:
        f.write(json.dumps({"mode": MODE, "zero_optimizer": type(optimizer).__name__,
                            "base_optimizer": type(base).__name__ if base is not None else None}) + "\n")


def _compare_nested(compare):
    """DeepSpeed's checkpoint tests' compare_state_dicts, descending into nested dicts: bitsandbytes 0.50 keeps a
    parameter's 8-bit state in its state_dict under '__bnb_optimizer_quant_state__' (a dict of tensors), which the
    flat comparison meets with `dict == dict` ("Boolean value of Tensor ... is ambiguous"). Stock states hold no
    nested dicts, so both modes compare alike."""
    def compare_state_dicts(state0, state1, expected_mismatch_keys=[], path=""):
        assert set(state0) - set(expected_mismatch_keys) == set(state1) - set(expected_mismatch_keys), \
            f"{path or 'the state'}: keys {sorted(map(str, state0))} against {sorted(map(str, state1))}"
        for k in sorted(set(state0) - set(expected_mismatch_keys), key=str):
            if isinstance(state0[k], dict) and isinstance(state1[k], dict):
                compare_state_dicts(state0[k], state1[k], expected_mismatch_keys, f"{path}{k}.")
                continue
            try:
                compare({k: state0[k]}, {k: state1[k]})
            except AssertionError as failure:  # name what differs: the flat comparison's assert says nothing
                a, b = state0[k], state1[k]
                shapes = f" (shapes {tuple(a.shape)} and {tuple(b.shape)})" if hasattr(a, "shape") else ""
                raise AssertionError(f"state key {path}{k} differs{shapes}") from failure
    return compare_state_dicts


class _AfterImport:
    """A meta-path finder that patches unit.checkpoint.common once it has been executed."""

    TARGET = "unit.checkpoint.common"

    def find_spec(self, name, path=None, target=None):
        if name != self.TARGET:
            return None
        import importlib.machinery
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            module.compare_state_dicts = _compare_nested(module.compare_state_dicts)
        spec.loader.exec_module = exec_module
        return spec


def _install() -> None:
    import deepspeed
    if MODE == "bnb":
        import deepspeed_bnb  # noqa: F401  (before any engine, as a user's script imports it)
    original = deepspeed.initialize

    def initialize(*args, **kwargs):
        if MODE == "bnb":
            kwargs = _bnb_optimizer(kwargs)
        result = original(*args, **kwargs)
        _log(result[0])
        return result
    deepspeed.initialize = initialize


if MODE in ("stock", "bnb") and os.environ.get("DEEPSPEED_BNB_UNIT_LOG"):
    import sys
    sys.meta_path.insert(0, _AfterImport())
    _install()
