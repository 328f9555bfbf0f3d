"""What the framework command-line tests (tests/distributed/test_trl_cli.py) run: a tiny model and dataset written
locally (no download), the DeepSpeed and Accelerate configs the command reads, and the command itself, with and
without `deepspeed-bnb run` in front of it.

The model is a 2-layer GPT-2 without dropout (a resumed run on other ranks draws no other masks) over transformers'
ByT5 byte tokenizer (no vocabulary file); every text is 63 ASCII bytes, 64 tokens with the end-of-sequence token, so
no batch is padded and a step's mean loss is the same however the global batch is split over ranks.
"""

import json
import os
import random
import subprocess
import sys

BIN = os.path.dirname(sys.executable)
TEXT_BYTES = 63
# the DeepSpeed config: no deepspeed_bnb key (their defaults), so the same file serves the stock control
DEEPSPEED = {"bf16": {"enabled": "auto"}, "train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto",
             "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "zero_optimization": {"stage": 2},
             "steps_per_print": 10**6}
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
    """The model, the dataset and both configs under `folder`; their paths."""
    from transformers import AddedToken, ByT5Tokenizer, GPT2Config, GPT2LMHeadModel
    paths = {name: os.path.join(folder, name) for name in ("model", "data", "ds.json", "accelerate.yaml")}
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
    with open(paths["ds.json"], "w") as f:
        json.dump(DEEPSPEED, f)
    with open(paths["accelerate.yaml"], "w") as f:
        f.write(ACCELERATE.format(deepspeed=paths["ds.json"]))
    return paths


def environment() -> dict:
    """This environment without rank variables, offline, one OpenMP thread per rank."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                           "MASTER_PORT", "DEEPSPEED_BNB_RUN")}
    env.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               PATH=BIN + os.pathsep + env.get("PATH", ""))
    return env


def run(argv, log: str, wrapped: bool, timeout: int = 900) -> int:
    """`argv` (`deepspeed-bnb run -- argv` when `wrapped`), its output written to `log`; its exit code."""
    cmd = ([os.path.join(BIN, "deepspeed-bnb"), "run", "--"] if wrapped else []) + list(argv)
    with open(log, "w") as out:
        return subprocess.run(cmd, env=environment(), stdout=out, stderr=subprocess.STDOUT, timeout=timeout).returncode


def logged_losses(output_dir: str, step: int) -> dict:
    """step -> loss from the Trainer state of `output_dir`/checkpoint-`step` (the log the framework keeps)."""
    with open(os.path.join(output_dir, f"checkpoint-{step}", "trainer_state.json")) as f:
        return {entry["step"]: entry["loss"] for entry in json.load(f)["log_history"] if "loss" in entry}
