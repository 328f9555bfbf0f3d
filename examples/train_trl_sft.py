"""Demo: TRL's SFTTrainer with optim="adamw_bnb_8bit" under DeepSpeed ZeRO-2 or ZeRO-3, resuming at another number of
ranks.

    torchrun --nproc_per_node 2 examples/train_trl_sft.py --output_dir checkpoints/sft --save_steps 30
    torchrun --nproc_per_node 1 examples/train_trl_sft.py --output_dir checkpoints/sft_1rank \
        --resume checkpoints/sft/checkpoint-30
    (ZeRO-3: add --deepspeed configs/zero3_trl_sft.json to both)

Supervised fine-tuning as TRL does it: a `datasets.Dataset` of text (windows of the Python standard library's source,
no download), tokenized by SFTTrainer itself with a byte-level tokenizer (transformers' ByT5Tokenizer, which needs no
vocabulary file), an end-of-sequence token appended, the loss over every token. A tiny GPT-2 built from a config
learns it for 60 steps; the second command repeats steps 31-60 on one rank from the two-rank checkpoint, with the same
losses (within bf16 noise). The DeepSpeed config (configs/zero2_trl_sft.json) leaves bf16 to SFTConfig ("auto"),
which turns it on by default, as it does gradient checkpointing. SFTTrainer is an HF Trainer: it creates bitsandbytes'
8-bit AdamW itself, and `import deepspeed_bnb` makes DeepSpeed step it with deepspeed_bnb's ZeRO optimizer. Every
example has the same number of tokens, so no batch is padded and a step's loss is the same mean whichever way the
global batch is split over ranks.
"""

import os

from datasets import Dataset
from transformers import AddedToken, ByT5Tokenizer
from trl import SFTConfig, SFTTrainer

import deepspeed_bnb  # noqa: F401  (teaches DeepSpeed the bnb_* keys and the block-aware ZeRO optimizer)
from deepspeed_bnb.demo.text import ByteWindows, stdlib_bytes
from deepspeed_bnb.utils.teardown import finish
# the HF Trainer example beside this one (a script's own folder is the first entry of sys.path)
from train_hf_trainer import LossLog, parse_args, report, tiny_gpt2, training_arguments, world_size

HERE = os.path.dirname(os.path.abspath(__file__))


def text_dataset(args) -> Dataset:
    """`max_steps * global_batch` windows of `context` bytes of stdlib source as text (ASCII: one token per byte;
    other bytes and '<', which could spell a special token, become '?')."""
    data = stdlib_bytes(args.text_mb << 20).clone()
    data[(data > 126) | (data < 9) | (data == ord("<"))] = ord("?")
    windows = ByteWindows(data, args.context - 1, args.max_steps * args.global_batch, seed=args.seed)
    return Dataset.from_dict({"text": [bytes(windows[i].tolist()).decode("ascii") for i in range(len(windows))]})


def main(argv=None) -> dict:
    args = parse_args(argv, default_output_dir="checkpoints/sft",
                      default_config=os.path.join(HERE, "..", "configs", "zero2_trl_sft.json"))
    world = world_size(args)
    # SFTTrainer appends the eos text to each example; ByT5 would strip the whitespace next to it (the stock eos is
    # lstrip), which makes examples ending in spaces shorter: context + 1 tokens each only without that
    tokenizer = ByT5Tokenizer(eos_token=AddedToken("</s>", lstrip=False, rstrip=False))
    model = tiny_gpt2(args, vocab_size=len(tokenizer), positions=args.context + 1, eos_token_id=tokenizer.eos_token_id)
    config = training_arguments(args, world, SFTConfig, max_length=args.context + 1, packing=False,
                                dataset_text_field="text", dataset_num_proc=None)
    losses = LossLog()
    trainer = SFTTrainer(model=model, args=config, train_dataset=text_dataset(args), processing_class=tokenizer,
                         callbacks=[losses])
    lengths = {len(ids) for ids in trainer.train_dataset["input_ids"]}
    if lengths != {args.context + 1}:  # a padded batch would make the loss depend on how the batch is split
        raise RuntimeError(f"SFTTrainer tokenized the examples to {sorted(lengths)} tokens, not {args.context + 1}")
    trainer.train(resume_from_checkpoint=args.resume)
    return report(trainer, losses, args)


if __name__ == "__main__":
    main()
    # torch's gloo group can abort in C++ at interpreter exit (SIGABRT) after a finished run, and the launcher would
    # report a failure: leave the group and exit without the interpreter's teardown (deepspeed_bnb/utils/teardown.py)
    finish()
