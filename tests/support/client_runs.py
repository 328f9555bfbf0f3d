"""Runs the client examples (examples/train_accelerate.py, examples/train_hf_trainer.py, examples/train_trl_sft.py)
several times in one process.

For tests/distributed/test_clients.py and tests/distributed/test_trl.py, under `accelerate launch` or torchrun (a launch
costs seconds on 2 cores, so one launch does several runs, one after the other). Each run is `NAME:ARGS` (ARGS as one
shell-quoted string, passed to the example's main; the example is `accelerate`, `trainer` or `trl`); a NAME ending in
`-weights-only` resumes without the optimizer state (the negative control). Rank 0 writes OUT/imports.json: whether
`import deepspeed_bnb` imported Accelerate, and who patches it afterwards.

    torchrun --nproc_per_node 1 tests/support/client_runs.py trainer OUT \
        "resume:--resume ... --log_json OUT/resume.json"
"""

import contextlib
import json
import os
import shlex
import sys

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, TESTS)  # `import support` (support/__init__.py)

import deepspeed_bnb  # noqa: F401  (first, before anything imports Accelerate: the patch must arrive lazily)

ACCELERATE_IMPORTED_WITH_DEEPSPEED_BNB = "accelerate" in sys.modules

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tiny models from configs: nothing to download, and no network here

from accelerate import Accelerator
from accelerate.state import AcceleratorState, GradientState

from deepspeed_bnb.utils.teardown import finish
from support import examples

train_accelerate = examples.load("train_accelerate")
train_hf_trainer = examples.load("train_hf_trainer")


@contextlib.contextmanager
def trainer_resumes_without_optimizer_state():
    """Trainer's DeepSpeed resume helper, loading weights, step and lr schedule but not the optimizer state."""
    import transformers.trainer as hf_trainer
    stock = hf_trainer.deepspeed_load_checkpoint

    def weights_only(engine, path, load_module_strict=True):
        loaded, _ = engine.load_checkpoint(path, load_module_strict=load_module_strict, load_optimizer_states=False)
        if loaded is None:
            raise FileNotFoundError(f"no DeepSpeed checkpoint in {path}")

    hf_trainer.deepspeed_load_checkpoint = weights_only
    try:
        yield
    finally:
        hf_trainer.deepspeed_load_checkpoint = stock


def main():
    example, out, *runs = sys.argv[1:]
    for index, run in enumerate(runs):
        if index:  # Accelerate refuses a second Accelerator with a DeepSpeed plugin; its own tests reset like this
            AcceleratorState._reset_state()
            GradientState._reset_state()
        name, args = run.split(":", 1)
        argv = shlex.split(args)
        if example == "accelerate":
            train_accelerate.main(argv + (["--resume_without_optimizer_state"] if name.endswith("-weights-only")
                                          else []))
        else:
            if example == "trl":
                train_trl_sft = examples.load("train_trl_sft")  # needs trl (and datasets), as the others do not
            with trainer_resumes_without_optimizer_state() if name.endswith("-weights-only") else \
                    contextlib.nullcontext():
                (train_trl_sft if example == "trl" else train_hf_trainer).main(argv)
    if torch.distributed.get_rank() == 0:
        with open(os.path.join(out, "imports.json"), "w") as f:
            json.dump({"accelerate_imported_by_deepspeed_bnb": ACCELERATE_IMPORTED_WITH_DEEPSPEED_BNB,
                       "prepare_deepspeed_from": Accelerator._prepare_deepspeed.__module__}, f)


if __name__ == "__main__":
    main()
    # every result is written: leave the group and skip the interpreter's teardown, where gloo can abort an otherwise
    # finished launch (deepspeed_bnb/utils/teardown.py)
    finish()
