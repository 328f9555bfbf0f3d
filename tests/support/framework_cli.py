"""What the framework command-line tests (tests/distributed/test_{trl,llamafactory,axolotl}_cli.py) run: a tiny model
and dataset written locally (no download), the configs the command reads, the venvs of frameworks whose pins conflict
with the suite's, and the command itself, with and without `deepspeed-bnb run` in front of it.

The model is a 2-layer GPT-2 without dropout (a resumed run on other ranks draws no other masks) over transformers'
ByT5 byte tokenizer (no vocabulary file); every text is 63 ASCII bytes, 64 tokens with the end-of-sequence token, so
no batch is padded and a step's mean loss is the same however the global batch is split over ranks.
"""

import json
import os
import random
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TEXT_BYTES = 63
# the DeepSpeed config: no deepspeed_bnb key (their defaults), so the same file serves the stock control
DEEPSPEED = {"bf16": {"enabled": "auto"}, "train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto",
             "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "zero_optimization": {"stage": 2},
             "steps_per_print": 10**6}
ZERO2 = {"stage": 2}
ZERO3 = {"stage": 3, "stage3_gather_16bit_weights_on_model_save": True}
# name -> (zero_optimization, keys of DEEPSPEED left out)
DEEPSPEED_CONFIGS = {
    "ds": (ZERO2, ()),
    "ds_offload": ({**ZERO2, "offload_optimizer": {"device": "cpu"}}, ()),  # zero_force_ds_cpu_optimizer left out
    "ds_zero3": (ZERO3, ()),
    "ds_convert_stock": ({**ZERO2, "bnb_convert_stock_on_load": True}, ()),  # a stock run's checkpoint resumed
    # train_batch_size left to DeepSpeed, which derives it: on CPU ranks an "auto" one is filled for another number of
    # ranks than DeepSpeed's batch check sees. Under LLaMA-Factory, transformers' from_pretrained enters ZeRO-3's
    # zero.Init before the process group exists, where the check sees one rank against the Trainer's batch for all
    # ("8 != 4 * 1 * 1"); under Axolotl, Accelerate counts one process (Axolotl makes its distributed state before
    # DeepSpeed's process group, without Accelerate's cpu flag), so the Trainer fills it for one rank and the check
    # stops every run at more ("4 != 4 * 1 * 2")
    "ds_derived": (ZERO2, ("train_batch_size",)),
    "ds_zero3_derived": (ZERO3, ("train_batch_size",)),
}
ACCELERATE = """compute_environment: LOCAL_MACHINE
distributed_type: DEEPSPEED
deepspeed_config:
  deepspeed_config_file: {deepspeed}
  zero3_init_flag: false
use_cpu: true
num_machines: 1
num_processes: 2
machine_rank: 0
rdzv_backend: static
same_network: true
"""


def write_assets(folder: str) -> dict:
    """The model, the dataset, and each of DEEPSPEED_CONFIGS as NAME.json with an Accelerate config reading it
    (accelerate_SUFFIX.yaml for ds_SUFFIX.json; accelerate.yaml for ds.json) under `folder`; their paths."""
    from transformers import AddedToken, ByT5Tokenizer, GPT2Config, GPT2LMHeadModel
    paths = {name: os.path.join(folder, name) for name in ("model", "data")}
    tokenizer = ByT5Tokenizer(eos_token=AddedToken("</s>", lstrip=False, rstrip=False))
    config = GPT2Config(vocab_size=len(tokenizer), n_positions=TEXT_BYTES + 1, n_embd=64, n_layer=2, n_head=4,
                        eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.eos_token_id,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    GPT2LMHeadModel(config).save_pretrained(paths["model"])
    tokenizer.save_pretrained(paths["model"])
    words = "the quick brown fox jumps over a lazy dog while eight bit states stay whole across ranks".split()
    rng = random.Random(0)
    os.makedirs(paths["data"], exist_ok=True)
    with open(os.path.join(paths["data"], "train.jsonl"), "w") as f:
        for _ in range(96):
            text = " ".join(rng.choice(words) for _ in range(40))[:TEXT_BYTES].ljust(TEXT_BYTES, ".")
            f.write(json.dumps({"text": text}) + "\n")
    for name, (zero, without) in DEEPSPEED_CONFIGS.items():
        config = {key: value for key, value in DEEPSPEED.items() if key not in without}
        paths[f"{name}.json"] = os.path.join(folder, f"{name}.json")
        paths[f"accelerate{name[2:]}.yaml"] = os.path.join(folder, f"accelerate{name[2:]}.yaml")
        with open(paths[f"{name}.json"], "w") as f:
            json.dump({**config, "zero_optimization": zero}, f)
        with open(paths[f"accelerate{name[2:]}.yaml"], "w") as f:
            f.write(ACCELERATE.format(deepspeed=paths[f"{name}.json"]))
    return paths


def environment(python: str = sys.executable, **extra) -> dict:
    """This environment without rank variables, offline, one OpenMP thread per rank, with `python`'s venv first on
    PATH (its own JIT cache, and this checkout's deepspeed_bnb on PYTHONPATH where it is another venv's)."""
    from conftest import without_launch_vars
    env = {k: v for k, v in without_launch_vars().items() if k != "DEEPSPEED_BNB_RUN"}
    bin_dir = os.path.dirname(python)
    env.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               PATH=bin_dir + os.pathsep + env.get("PATH", ""))
    if os.path.abspath(python) != os.path.abspath(sys.executable):
        env["TORCH_EXTENSIONS_DIR"] = os.path.join(os.path.dirname(bin_dir), "torch_extensions")
        env["PYTHONPATH"] = os.pathsep.join([ROOT] + [p for p in [env.get("PYTHONPATH")] if p])
    env.update(extra)
    return env


def run(argv, log: str, wrapped: bool, timeout: int = 900, python: str = sys.executable, **env) -> int:
    """`argv` (`deepspeed-bnb run -- argv` when `wrapped`) run with `python`'s venv, its output written to `log`;
    its exit code. `env`: variables to set (a framework's own launch switches)."""
    cmd = ([python, "-m", "deepspeed_bnb_tools", "run", "--"] if wrapped else []) + list(argv)
    with open(log, "w") as out:
        return subprocess.run(cmd, env=environment(python, **env), stdout=out, stderr=subprocess.STDOUT,
                              timeout=timeout).returncode


def read(log: str) -> str:
    with open(log) as f:
        return f.read()


def resume_gap(uninterrupted: str, resumed: str) -> float:
    """The largest difference between the losses of steps 4-6 of the `resumed` run (from checkpoint-3) and of the run
    that never stopped, each read from its checkpoint-6; an AssertionError where either did not log steps 1-6, or
    where the uninterrupted run did not train (a resume of a frozen run would prove nothing)."""
    never_stopped, again = logged_losses(uninterrupted, 6), logged_losses(resumed, 6)
    if sorted(never_stopped) != list(range(1, 7)) or sorted(again) != list(range(1, 7)):
        raise AssertionError(f"steps 1-6 not all logged: {never_stopped}, {again}")
    if not never_stopped[6] < never_stopped[1] - 0.1:
        raise AssertionError(f"the uninterrupted run did not train: {never_stopped}")
    return max(abs(again[step] - never_stopped[step]) for step in (4, 5, 6))


def _write_yaml(lines, output_dir: str, resume: str) -> str:
    """`lines` (and the framework's resume_from_checkpoint: `resume`, if any) as output_dir.yaml; its path."""
    if resume:
        lines = [*lines, f"resume_from_checkpoint: {resume}"]
    path = output_dir + ".yaml"
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    return path


def logged_losses(output_dir: str, step: int) -> dict:
    """step -> loss from the Trainer state of `output_dir`/checkpoint-`step` (the log the framework keeps)."""
    with open(os.path.join(output_dir, f"checkpoint-{step}", "trainer_state.json")) as f:
        return {entry["step"]: entry["loss"] for entry in json.load(f)["log_history"] if "loss" in entry}


# ---- frameworks whose pins conflict with the suite's run from venvs of their own, built once and kept --------------

FRAMEWORKS = os.path.join(os.path.expanduser("~"), ".cache", "deepspeed_bnb", "frameworks")
# LLaMA-Factory 0.9.5 pins transformers <= 5.6, Accelerate <= 1.11, TRL <= 0.24, datasets <= 4.0, DeepSpeed <= 0.18.4
LLAMAFACTORY = ("llamafactory-0.9.5", ("llamafactory==0.9.5", "deepspeed==0.18.4", "bitsandbytes==0.50.2", "ninja",
                # its multimodal plugin imports torchaudio and transformers imports torchvision whenever present: a
                # torch with matching builds on the package index (torchaudio 2.11 on is Python only)
                "torch==2.14.1", "torchvision==0.29.1", "torchaudio==2.11.1"))
# Axolotl 0.19.0 pins transformers 5.16.1, TRL 1.9.0, torch 2.11-2.13, DeepSpeed 0.18.6-0.18.x (its extra)
AXOLOTL = ("axolotl-0.19.0", ("axolotl[deepspeed]==0.19.0", "deepspeed==0.18.9", "bitsandbytes==0.50.2", "ninja",
                              "torch==2.13.0"))


def framework_python(framework) -> str:
    """The Python of `framework`'s venv ((folder, requirements): LLAMAFACTORY, AXOLOTL), built (minutes: torch is a
    few GB) the first time; a RuntimeError with pip's output where it cannot be built (no package index)."""
    folder, requirements = framework
    venv = os.path.join(FRAMEWORKS, folder)
    python = os.path.join(venv, "bin", "python")
    done = os.path.join(venv, ".complete")
    if not os.path.exists(done):
        subprocess.run([sys.executable, "-m", "venv", "--clear", venv], check=True)
        pip = subprocess.run([python, "-m", "pip", "install", "-q", *requirements], capture_output=True, text=True)
        if pip.returncode != 0:
            raise RuntimeError(f"{folder}'s venv could not be built: {(pip.stdout + pip.stderr)[-3000:]}")
        open(done, "w").close()
    return python


def write_llamafactory_assets(folder: str) -> dict:
    """write_assets(), and an alpaca-format dataset registered in a dataset_info.json."""
    paths = write_assets(folder)
    rng = random.Random(0)
    words = "the quick brown fox jumps over a lazy dog while eight bit states stay whole".split()
    rows = [{"instruction": " ".join(rng.choice(words) for _ in range(4)), "input": "",
             "output": " ".join(rng.choice(words) for _ in range(6))} for _ in range(96)]
    paths["lf_data"] = os.path.join(folder, "lf_data")
    os.makedirs(paths["lf_data"], exist_ok=True)
    with open(os.path.join(paths["lf_data"], "train.json"), "w") as f:
        json.dump(rows, f)
    with open(os.path.join(paths["lf_data"], "dataset_info.json"), "w") as f:
        json.dump({"tiny": {"file_name": "train.json"}}, f)
    return paths


def llamafactory_config(paths: dict, deepspeed: str, output_dir: str, ranks: int, resume: str = "") -> str:
    """A `llamafactory-cli train` YAML: full SFT of the tiny model, `optim: adamw_bnb_8bit`, 6 steps of a global
    batch of 8, a checkpoint at 3, fp32, the DeepSpeed JSON paths[`deepspeed`]; its path."""
    lines = [f"model_name_or_path: {paths['model']}", "stage: sft", "do_train: true", "finetuning_type: full",
             f"deepspeed: {paths[deepspeed]}", "dataset: tiny", f"dataset_dir: {paths['lf_data']}",
             "template: empty", "cutoff_len: 64", "overwrite_cache: true", "preprocessing_num_workers: 1",
             f"output_dir: {output_dir}", "logging_steps: 1", "save_steps: 3",
             f"per_device_train_batch_size: {8 // ranks}", "learning_rate: 1.0e-3", "max_steps: 6",
             "optim: adamw_bnb_8bit", "report_to: none", "bf16: false", "use_cpu: true", "seed: 0"]
    return _write_yaml(lines, output_dir, resume)


def axolotl_config(paths: dict, deepspeed: str, output_dir: str, resume: str = "") -> str:
    """An `axolotl train` YAML: full fine-tuning of the tiny model on write_assets()'s texts as completions,
    `optimizer: adamw_bnb_8bit`, 6 steps of micro batches of 4, a checkpoint at 3, fp32, the DeepSpeed JSON
    paths[`deepspeed`]; its path. (Every rank trains
    on the same micro batches on CPU ranks, where Accelerate counts one process: the run is the same at any number of
    ranks, which is what a resume at another number is held to.)"""
    lines = [f"base_model: {paths['model']}", "datasets:", f"  - path: {os.path.join(paths['data'], 'train.jsonl')}",
             "    ds_type: json", "    type: completion", "    field: text",
             f"dataset_prepared_path: {output_dir}_prepared", "sequence_len: 64", "sample_packing: false",
             "micro_batch_size: 4", "gradient_accumulation_steps: 1", "max_steps: 6", "optimizer: adamw_bnb_8bit",
             "learning_rate: 0.001", "lr_scheduler: constant",
             f"deepspeed: {paths[deepspeed]}", f"output_dir: {output_dir}", "save_steps: 3",
             "logging_steps: 1", "bf16: false", "fp16: false", "tf32: false", "seed: 0", "val_set_size: 0"]
    return _write_yaml(lines, output_dir, resume)
