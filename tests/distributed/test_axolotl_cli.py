"""Axolotl's own command line, `axolotl train config.yml --launcher torchrun -- --nproc_per_node 3`, with
`optimizer: adamw_bnb_8bit` under ZeRO-3 on 3 CPU ranks, turned on by `deepspeed-bnb run` in front of the unchanged
command, resumed on 2 ranks with its own `resume_from_checkpoint`.

Axolotl 0.19.0 (the release on the package index) pins transformers, TRL and torch away from the suite's, so it runs
from a venv of its own (tests/support/framework_cli.py: built once, minutes). Oracle: the run that never stopped (its
trainer_state.json). Control: the same commands without `deepspeed-bnb run`: stock DeepSpeed refuses the resume.

What CPU ranks allow (Axolotl 0.19.0, any optimizer, stock alike): not 1 rank (Axolotl initialises DeepSpeed's comm
with the NCCL backend when WORLD_SIZE is 1), hence 3 -> 2 where the other framework tests resume 2 -> 1; not ZeRO-1/2
at more than one rank (Axolotl loads the model with device_map {"": LOCAL_RANK}, a GPU index; ZeRO-3 loads without
one), asserted below so a release that changes it is noticed. In `make test-frameworks`.
"""

import os

import pytest

from support import framework_cli

pytestmark = [pytest.mark.multi_rank, pytest.mark.frameworks]
FP32_TOL = 1e-5  # the project's bar for a resume at another size in fp32 (measured: 0.0)


@pytest.fixture(scope="module")
def axolotl(tmp_path_factory):
    try:
        python = framework_cli.framework_python(framework_cli.AXOLOTL)
    except RuntimeError as exc:
        pytest.skip(str(exc))
    return python, framework_cli.write_assets(str(tmp_path_factory.mktemp("axolotl")))


# ZeRO stage -> the DeepSpeed JSON its runs read (on CPU ranks without train_batch_size: framework_cli says why)
JSONS = {2: "ds_derived.json", 3: "ds_zero3_derived.json"}


def train(axolotl, stage, name, ranks, wrapped, resume=""):
    """One `axolotl train` through its torchrun launcher: (exit code, its log, its output folder)."""
    from conftest import free_port
    python, paths = axolotl
    out = os.path.join(os.path.dirname(paths["model"]), name)
    config = framework_cli.axolotl_config(paths, JSONS[stage], out, resume)
    log = out + ".log"
    argv = ["axolotl", "train", config, "--launcher", "torchrun", "--",
            f"--nproc_per_node={ranks}", f"--master_port={free_port()}"]
    rc = framework_cli.run(argv, log, wrapped, python=python, AXOLOTL_DO_NOT_TRACK="1", DO_NOT_TRACK="1")
    return rc, framework_cli.read(log), out


def test_axolotl_trains_the_8bit_state_with_deepspeed_bnb_and_resumes_on_another_number_of_ranks(axolotl):
    rc, log, three = train(axolotl, 3, "ours_z3_3ranks", 3, wrapped=True)
    assert rc == 0, log[-5000:]
    assert "deepspeed_bnb's BnbZeroStage3Optimizer steps bitsandbytes.optim.adamw.AdamW's state under ZeRO stage 3" \
        in log, log[-5000:]
    assert "has not been tested" not in log  # Axolotl 0.19.0 is a tested release
    rc, log, two = train(axolotl, 3, "ours_z3_2ranks", 2, wrapped=True, resume=os.path.join(three, "checkpoint-3"))
    assert rc == 0, log[-5000:]
    assert framework_cli.resume_gap(three, two) < FP32_TOL  # steps 4-6 against the run that never stopped


def test_the_same_commands_without_deepspeed_bnb_cannot_resume_on_another_number_of_ranks(axolotl):
    rc, log, three = train(axolotl, 3, "stock_z3_3ranks", 3, wrapped=False)
    assert rc == 0 and "deepspeed-bnb run" not in log, log[-5000:]
    rc, log, _ = train(axolotl, 3, "stock_z3_2ranks", 2, wrapped=False, resume=os.path.join(three, "checkpoint-3"))
    assert rc != 0 and "used a DP world size of 3 but the current world size is 2" in log, log[-5000:]


def test_zero2_on_several_cpu_ranks_stops_in_axolotls_model_load(axolotl):
    """Axolotl places the model on GPU LOCAL_RANK whenever more than one rank runs without ZeRO-3: on CPU ranks
    transformers' from_pretrained stops ("Cannot access accelerator device when none is available"), before any
    optimizer exists. Should a release change that, this fails and a ZeRO-2 case should join the test above."""
    rc, log, _ = train(axolotl, 2, "z2_2ranks", 2, wrapped=True)
    assert rc != 0 and "Cannot access accelerator device when none is available" in log, log[-5000:]
    assert "from_pretrained" in log and "BnbZero" not in log
