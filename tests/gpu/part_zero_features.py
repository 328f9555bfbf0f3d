"""GPU proof, part g: the ZeRO features deepspeed_bnb refuses with bnb optimizers, as stock DeepSpeed runs them here.

ZenFlow (ZeRO-2, CPU offload), SuperOffload (ZeRO-3, CPU offload) and Twin-Flow (ZeRO-3, `offload_optimizer.ratio`
0.5) each step the optimizer with DeepSpeed's own CPU Adam code. This part records what stock DeepSpeed (every
deepspeed_bnb replacement taken back) does with each when the client optimizer is torch AdamW and when it is bnb
AdamW8bit (and, on the GPU, with no client optimizer: the config's AdamW, which DeepSpeed builds as its CPU Adam, the
route these features are made for): the error it raises, or the losses of 4 steps beside the same run without the
feature, and whether the bnb optimizer holds any state afterwards (none: something else stepped the weights). That
table is the evidence behind deepspeed_bnb's refusals; it is measured, not a claim, so it has no bar.
Checks: (control) stock DeepSpeed trains the feature-off configuration with bnb AdamW8bit (the harness can train at
all, so an error in a feature row is the feature's); deepspeed_bnb refuses each feature with bnb AdamW8bit at
initialize with an error that names the setting.
On the CPU (the rehearsal) SuperOffload stops at DeepSpeed's CUDA check, and the config-optimizer rows are left out
(DeepSpeed's CPU Adam takes minutes to JIT-build on 2 cores; run by hand here, ZenFlow then trains with ZenFlowCPUAdam).
qwZ/qgZ are not here: at one rank DeepSpeed gathers nothing (qwZ) and reduces across no nodes (qgZ), so a single GPU
cannot exercise them.
"""

import proof_common as common  # first: it puts tests/ on the path

STEPS = 4
LR = 1e-3
CONFIGURED = "DeepSpeed's AdamW"  # the config's optimizer section, no client optimizer: the route these features take
ZENFLOW = {"topk_ratio": 0.1, "select_strategy": "step", "select_interval": 2, "update_interval": 2,
           "overlap_step": False, "full_warm_up_rounds": 0}
# feature -> (stage, zero_optimization without the feature, the feature's additions, the setting a refusal names)
FEATURES = {
    "ZenFlow": (2, {"offload_optimizer": {"device": "cpu"}}, {"zenflow": ZENFLOW}, "zenflow"),
    "SuperOffload": (3, {"offload_optimizer": {"device": "cpu"}},
                     {"offload_optimizer": {"device": "cpu", "super_offload": True}}, "super_offload"),
    "Twin-Flow": (3, {"offload_optimizer": {"device": "cpu"}},
                  {"offload_optimizer": {"device": "cpu", "ratio": 0.5}}, "offload_optimizer.ratio"),
}


def optimizer_of(kind: str, model):
    import bitsandbytes as bnb
    import torch

    from support.toy import param_groups
    return (bnb.optim.AdamW8bit if kind == "bnb AdamW8bit" else torch.optim.AdamW)(param_groups(model, lr=LR))


def engine_of(kind: str, stage: int, zero: dict, device: str):
    """A one-rank engine of the toy model with the optimizer `kind` and these zero_optimization settings; returns it
    and the client optimizer (None for DeepSpeed's own, which its config names)."""
    import deepspeed

    from support.toy import ds_config, make_model
    model = make_model(0).to(device)
    config = ds_config(1, stage=stage, **zero)
    if kind == CONFIGURED:
        config["optimizer"] = {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}}
        return deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)[0], None
    optimizer = optimizer_of(kind, model)
    config.update(zero_force_ds_cpu_optimizer=False, zero_allow_untested_optimizer=True)
    return deepspeed.initialize(model=model, optimizer=optimizer, config=config)[0], optimizer


def stock_run(kind: str, stage: int, zero: dict, device: str) -> dict:
    """Losses of STEPS steps under stock DeepSpeed, or the error that stopped it; whether the client holds state."""
    from deepspeed_bnb.installer import stock_deepspeed
    from support.toy import global_batch, loss_fn
    try:
        with stock_deepspeed():
            engine, client = engine_of(kind, stage, zero, device)
            losses = []
            for step in range(STEPS):
                tokens, targets = (t.to(device) for t in global_batch(step))
                loss = loss_fn(engine, tokens, targets)
                engine.backward(loss)
                engine.step()
                losses.append(float(loss))
    except Exception as exc:  # the evidence: what stock DeepSpeed says
        return {"error": f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ''}"}
    stepper = type(getattr(engine.optimizer, "optimizer", engine.optimizer)).__name__
    held = None if client is None else sum(1 for s in client.state.values() if s)
    return {"losses": losses, "client_state": held, "stepper": stepper}


def describe(run: dict, base: dict) -> list:
    if "error" in run:
        return ["error", run["error"], "", ""]
    apart = max(abs(a - b) for a, b in zip(run["losses"], base["losses"])) if "losses" in base else float("nan")
    return ["trains", " ".join(f"{x:.4f}" for x in run["losses"]), f"{apart:.3g}",
            run["stepper"] + ("" if run["client_state"] is None else f"; client state entries {run['client_state']}")]


def refusal(stage: int, zero: dict, device: str) -> str:
    """deepspeed_bnb's answer to bnb AdamW8bit with the feature: the error's text ('' when it was accepted)."""
    import deepspeed_bnb  # noqa: F401  (its replacements are active outside stock_deepspeed())
    try:
        engine_of("bnb AdamW8bit", stage, zero, device)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return ""


def merged(base: dict, extra: dict) -> dict:
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in base.items()}
    for key, value in extra.items():
        out[key] = {**out.get(key, {}), **value} if isinstance(value, dict) else value
    return out


def body(args, result):
    common.one_rank(args.device)
    common.deterministic(args.device)
    rows = []
    for feature, (stage, base_zero, extra, setting) in FEATURES.items():
        for kind in ((CONFIGURED,) if args.device == "cuda" else ()) + ("torch AdamW", "bnb AdamW8bit"):
            base = stock_run(kind, stage, base_zero, args.device)
            run = stock_run(kind, stage, merged(base_zero, extra), args.device)
            rows.append([feature, kind, *describe(run, base)])
            if kind == "bnb AdamW8bit":
                result.check(f"g: (control) stock DeepSpeed trains bnb AdamW8bit at ZeRO-{stage} with CPU offload, "
                             f"without {feature}", "losses" in base and base["client_state"] > 0,
                             base.get("error") or f"{base['stepper']}, {base['client_state']} state entries",
                             "trains; bnb holds state")
        said = refusal(stage, merged(base_zero, extra), args.device)
        result.check(f"g: deepspeed_bnb refuses {feature} with bnb AdamW8bit, naming {setting}",
                     setting.split(".")[-1] in said, said[:300] or "accepted", f"refused, naming {setting}")
    result.table("g: stock DeepSpeed with each feature (one rank, 4 steps; 'apart': largest loss difference from the "
                 "same run without the feature)", ["feature", "client optimizer", "outcome", "losses or error",
                                                   "apart", "what stepped"], rows)


if __name__ == "__main__":
    common.run_part("g", "refused ZeRO features as stock DeepSpeed runs them", body)
