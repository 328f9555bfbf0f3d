"""The multi-rank scenarios (tests/support/distributed_scenarios.py), run once per test session for test_distributed.py
and test_elastic.py together, since each torchrun launch costs ~10 s of imports before any scenario runs.

DP=1 runs in the test process (one rank), first and last. Between them five launches: one per N in 2..4 that runs
test_distributed's scenarios of that world size (2 and 3), saves the elastic checkpoints and loads those of
N' <= N; then one per M in 2..3 that loads the checkpoints of the larger N (and, at M=3, the DP=1 ones rewritten
offline for 3 ranks by `deepspeed-bnb reshape`). The hpZ scenarios ride along: saved at N=4, loaded at M=2; so do
the universal-checkpoint loads of the DP=1 checkpoints, at N=2, and the model-parallel runs' 8-bit universal exports
(tensor-parallel 2 and 2 pipeline stages, saved at 2 and 4 ranks), loaded at model-parallel size 1 by the later
launch at 2 and in this process at the end, and cut again for their own model-parallel layout by the later launch at
2, as is the universal export of the same models trained at model-parallel size 1 in this process first; the 3D run
(tensor-parallel 2 x 2 stages) saves at 4 and its universal export loads at 2 (three layouts) and here at the end. Every
launch must succeed and no scenario may fail: the results are the union per world.
"""

import json
import os
import shutil

import torch

from conftest import torchrun

ALL_SIZES = (1, 2, 3, 4)
SIZES_ENV = "DEEPSPEED_BNB_SCENARIO_SIZES"  # e.g. "1,2": fewer launches (what the compatibility matrix's claims need)
SIZES = tuple(int(n) for n in os.environ.get(SIZES_ENV, ",".join(map(str, ALL_SIZES))).split(","))
if SIZES != ALL_SIZES[:len(SIZES)]:
    raise ValueError(f"{SIZES_ENV}={os.environ[SIZES_ENV]!r}: a prefix of {ALL_SIZES} (1,2 or 1,2,3 or 1,2,3,4)")
# data-parallel sizes of the elastic checkpoints (every N saves, every M loads)
DISTRIBUTED = {1: "train", 2: "train,resume,stock_elastic,whole_mismatch,param_state,rank_failures,stock_zero3_save,"
                  "stock_bnb_save,stock_lion_save,moe_frozen_save", 3: "train,resume"}
RESHAPED = "r1"  # elastic_load source: the DP=1 checkpoint reshaped offline for 3 ranks


PARALLEL = (2, 4)  # world sizes of the pipeline / tensor-parallel runs (model-parallel 2 x data-parallel 1 and 2)
HPZ_SAVE, HPZ_LOAD = 4, 2  # world sizes of hpZ's runs (tests/support/hpz_scenarios.py): saved at 4, loaded at 2


def hpz_runs() -> bool:
    """Whether this DeepSpeed runs hpZ with a bnb optimizer (0.19.5 on; before, deepspeed_bnb refuses it)."""
    from deepspeed_bnb.runtime.zero.compat import partitions_empty_secondary_chunks
    return HPZ_SAVE in SIZES and partitions_empty_secondary_chunks()
UNIVERSAL_LOAD = 2  # the world size that loads the DP-1 checkpoints through universal checkpoints
PARALLEL3D_SAVE, PARALLEL3D_LOADS = 4, (2, 1)  # tensor-parallel 2 x 2 stages saved at 4 ranks, loaded at 2 and 1


def plan():
    """(world size, scenarios, elastic sources) of each run, in order: every checkpoint is saved before it is loaded."""
    # (the pipeline / tensor-parallel scenarios come last in a launch: DeepSpeed keeps their model-parallel state in
    # module globals, and a later engine without a model-parallel unit then fails to initialize)
    first = [(w, ",".join(filter(None, [DISTRIBUTED.get(w, ""), "elastic_save", "elastic_load"] +
                                 (["parallel_whole_save"] if w == 1 and max(SIZES) in PARALLEL[1:] else []) +
                                 (["universal_load"] if w == UNIVERSAL_LOAD else []) +
                                 (["hpz_save"] if w == HPZ_SAVE and hpz_runs() else []) +
                                 (["parallel_save", "parallel_load"] if w in PARALLEL else []) +
                                 (["parallel3d_save"] if w == PARALLEL3D_SAVE else []))),
              [str(n) for n in SIZES[:w]]) for w in SIZES]
    later = [(w, "elastic_load" + (",hpz_load" if w == HPZ_LOAD and hpz_runs() else "")
              + (",parallel_load,parallel_universal,parallel_universal_split" if w in PARALLEL
                 and max(SIZES) in PARALLEL[1:] else "")
              + (",parallel3d_load" if w in PARALLEL3D_LOADS and PARALLEL3D_SAVE in SIZES else ""),
              [str(n) for n in SIZES[w:]] + ([RESHAPED] if w == 3 else [])) for w in SIZES[1:-1]]
    if 3 not in SIZES[1:-1]:  # the reshaped DP=1 checkpoint is loaded at 3 ranks only
        later = [(w, scenarios, [s for s in sources if s != RESHAPED]) for w, scenarios, sources in later]
    later.append((1, "elastic_load" + (",parallel_universal" if PARALLEL[0] in SIZES else "")
                  + (",parallel3d_load" if PARALLEL3D_SAVE in SIZES else ""),
                  [str(n) for n in SIZES[1:]]))  # in this process again: no launch
    return first + later


def in_this_process(out, world, scenarios, sources):
    """The scenarios distributed_scenarios.py would run at DP=1, run on the test's one-rank group (one thread, as a
    launched rank has)."""
    from support.distributed_scenarios import SCENARIOS, TAKES_SOURCES
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return {name: SCENARIOS[name](1, 0, out, *([sources] if name in TAKES_SOURCES else []))
                for name in scenarios.split(",")}
    finally:
        torch.set_num_threads(threads)


def launched(out, world, scenarios, sources):
    torchrun("support/distributed_scenarios.py", world, "--out", out, "--scenarios", scenarios,
             "--elastic-from", ",".join(sources))
    path = os.path.join(out, f"results_world{world}.json")
    with open(path) as f:
        result = json.load(f)
    os.remove(path)
    return result


def reshape_dp1_for_three(out):
    from deepspeed_bnb.checkpoint.tools.reshape import reshape
    from support.distributed_scenarios import RESHAPED_KINDS
    for kind, stage in RESHAPED_KINDS.items():
        folder = os.path.join(out, "elastic", kind)
        reshape(os.path.join(folder, "dp1"), os.path.join(folder, "reshaped1"), 3, progress=False, stage=stage)
        shutil.copy(os.path.join(folder, "dp1", "reference_state.pt"), os.path.join(folder, "reshaped1"))


def run_all(out) -> dict:
    """world -> scenario -> result (elastic_load: the union of that world's loads)."""
    results, exported, exported3d = {}, False, False
    for world, scenarios, sources in plan():
        if RESHAPED in sources:
            reshape_dp1_for_three(out)
        if "parallel_universal" in scenarios and not exported:  # every model-parallel checkpoint is saved by now
            from support.parallel_scenarios import MODEL_PARALLEL, export_universal
            export_universal(out, [w // MODEL_PARALLEL for w in PARALLEL if w in SIZES])
            exported = True
        if "parallel3d_load" in scenarios and not exported3d:  # saved at 4 ranks, in the first launch there
            from support import parallel3d_scenarios
            parallel3d_scenarios.export_universal(out)
            exported3d = True
        run = in_this_process if world == 1 else launched
        for name, value in run(out, world=world, scenarios=scenarios, sources=sources).items():
            assert "error" not in value, f"world {world}, scenario {name}:\n{value['error']}"
            if name in ("elastic_load", "parallel_load", "parallel_universal", "parallel_universal_split",
                        "parallel3d_load"):
                results.setdefault(world, {}).setdefault(name, {}).update(value)
            else:
                results.setdefault(world, {})[name] = value
    return results
