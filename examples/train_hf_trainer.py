"""Demo: Hugging Face Trainer with optim="adamw_bnb_8bit" under DeepSpeed ZeRO-2, resuming at another number of ranks.

    torchrun --nproc_per_node 2 examples/train_hf_trainer.py --output_dir checkpoints/trainer --save_steps 30
    torchrun --nproc_per_node 1 examples/train_hf_trainer.py --output_dir checkpoints/trainer_1rank \
        --resume checkpoints/trainer/checkpoint-30

A tiny GPT-2 built from a config (no download) learns the Python standard library's source as bytes for 60 steps.
The second command repeats steps 31-60 on one rank from the two-rank checkpoint, with the same losses. The DeepSpeed
config (configs/zero2_hf_trainer.json) holds the bnb_* keys; Trainer creates bitsandbytes' 8-bit AdamW itself, and
`import deepspeed_bnb` makes DeepSpeed step it with BnbZeroOptimizer. The global batch (--global_batch) is split over
however many ranks run, so every step sees the same sequences at any number of ranks.
"""

import argparse
import json
import os

import torch
from deepspeed.accelerator import get_accelerator
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

import deepspeed_bnb  # noqa: F401  (teaches DeepSpeed the bnb_* keys and the block-aware ZeRO optimizer)
from deepspeed_bnb.demo.text import ByteWindows, stdlib_bytes
from deepspeed_bnb.utils.teardown import finish

HERE = os.path.dirname(os.path.abspath(__file__))


def parse_args(argv=None, default_output_dir="checkpoints/trainer",
               default_config=os.path.join(HERE, "..", "configs", "zero2_hf_trainer.json")):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output_dir", default=default_output_dir, help="Trainer's output_dir (checkpoints)")
    parser.add_argument("--deepspeed", default=default_config,
                        help="DeepSpeed config (JSON)")
    parser.add_argument("--max_steps", type=int, default=60, help="optimizer steps of the whole run (default 60)")
    parser.add_argument("--save_steps", type=int, default=None, help="save every this many steps (default: at the "
                        "end)")
    parser.add_argument("--resume", default=None, help="a checkpoint-N folder of output_dir, saved at any number of "
                        "ranks")
    parser.add_argument("--global_batch", type=int, default=16, help="sequences per step over all ranks (default 16)")
    parser.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (default 3e-3)")
    parser.add_argument("--width", type=int, default=128, help="model width (default 128)")
    parser.add_argument("--depth", type=int, default=4, help="transformer blocks (default 4)")
    parser.add_argument("--context", type=int, default=128, help="bytes per sequence (default 128)")
    parser.add_argument("--seed", type=int, default=0, help="model init and data seed (default 0)")
    parser.add_argument("--text_mb", type=int, default=8, help="MB of stdlib source to draw windows from (default 8)")
    parser.add_argument("--local_rank", type=int, default=-1, help="set by the deepspeed launcher (unused)")
    parser.add_argument("--log_json", default=None, help="write the per-step losses and the optimizer classes here "
                        "(JSON)")
    return parser.parse_args(argv)


class LossLog(TrainerCallback):
    """Trainer's logged loss per optimizer step (logging_steps=1: the mean over all ranks of that step's loss)."""

    def __init__(self):
        self.losses = {}

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.losses[state.global_step] = logs["loss"]


def collate(windows):
    batch = torch.stack(windows)
    return {"input_ids": batch, "labels": batch}  # GPT-2 shifts the labels itself


def main(argv=None) -> dict:
    args = parse_args(argv)
    world = world_size(args)
    model = tiny_gpt2(args, vocab_size=256, positions=args.context + 1, eos_token_id=0)
    windows = ByteWindows(stdlib_bytes(args.text_mb << 20), args.context, args.max_steps * args.global_batch,
                          seed=args.seed)
    losses = LossLog()
    trainer = Trainer(model=model, args=training_arguments(args, world), train_dataset=windows, data_collator=collate,
                      callbacks=[losses])
    trainer.train(resume_from_checkpoint=args.resume)
    return report(trainer, losses, args)


def world_size(args) -> int:
    """The number of ranks of this launch, checked against --global_batch."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if args.global_batch % world:
        raise ValueError(f"--global_batch {args.global_batch} does not split over {world} ranks")
    return world


def tiny_gpt2(args, vocab_size: int, positions: int, eos_token_id: int) -> GPT2LMHeadModel:
    """A GPT-2 of --width and --depth from a config (no download), seeded by --seed."""
    torch.manual_seed(args.seed)
    # no dropout: runs at any rank count see the same model
    config = GPT2Config(vocab_size=vocab_size, n_positions=positions, n_embd=args.width, n_layer=args.depth,
                        n_head=max(1, args.width // 32), resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                        bos_token_id=eos_token_id, eos_token_id=eos_token_id)
    return GPT2LMHeadModel(config)


def training_arguments(args, world: int, arguments_class=TrainingArguments, **extra):
    """The run's TrainingArguments (or a subclass, such as TRL's SFTConfig, with its own fields in `extra`)."""
    return arguments_class(
        output_dir=args.output_dir,
        deepspeed=args.deepspeed,
        optim="adamw_bnb_8bit",
        learning_rate=args.lr,
        weight_decay=0.1,
        adam_beta2=0.95,
        warmup_steps=10,
        lr_scheduler_type="constant_with_warmup",
        max_grad_norm=1.0,
        per_device_train_batch_size=args.global_batch // world,
        max_steps=args.max_steps,
        save_strategy="steps",
        save_steps=args.save_steps or args.max_steps,
        logging_steps=1,
        report_to="none",
        seed=args.seed,
        # TrainingArguments' DeepSpeed branch sets up Accelerate without a process-group backend, and Accelerate 1.x
        # picks one only for GPU-like devices: on a CPU-only machine every rank then counts 1 process (each takes
        # the whole batch; DeepSpeed's batch-size check fails). use_cpu makes Accelerate start gloo with the real
        # world size, and DeepSpeed (its CPU accelerator) runs in that group.
        use_cpu=get_accelerator().device_name() == "cpu",
        disable_tqdm=True,
        **extra,
    )


def report(trainer, losses: LossLog, args) -> dict:
    """The run's losses and optimizer classes (printed by rank 0, and written to --log_json)."""
    engine = trainer.model_wrapped  # the DeepSpeed engine
    basic = engine.basic_optimizer  # what Trainer created (optim="adamw_bnb_8bit": bnb's AdamW, 8-bit state)
    log = {"world": trainer.args.world_size, "losses": losses.losses, "optimizer": type(engine.optimizer).__name__,
           "basic_optimizer": f"{type(basic).__module__}.{type(basic).__name__}",
           "optim_bits": getattr(getattr(basic, "args", None), "optim_bits", None),
           "offload": bool(engine.zero_cpu_offload()), "bf16": bool(engine.bfloat16_enabled()),
           "gradient_checkpointing": bool(trainer.args.gradient_checkpointing)}
    if trainer.is_world_process_zero():
        print(f"{log['optimizer']} over {log['basic_optimizer']} ({log['optim_bits']}-bit state) on {log['world']} "
              "ranks", flush=True)
        if args.log_json:
            with open(args.log_json, "w") as f:
                json.dump(log, f)
    return log


if __name__ == "__main__":
    main()
    # torch's gloo group can abort in C++ at interpreter exit (SIGABRT) after a finished run, and the launcher would
    # report a failure: leave the group and exit without the interpreter's teardown (deepspeed_bnb/utils/teardown.py)
    finish()
