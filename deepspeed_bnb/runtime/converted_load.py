"""Loading a checkpoint that a deepspeed_bnb engine cannot read as it is, through a deepspeed_bnb tag written once
beside it: a DeepSpeed universal checkpoint (universal_load.py), or a stock DeepSpeed run's optimizer state with
`zero_optimization.bnb_convert_stock_on_load` (`load_stock`).

A stock ZeRO checkpoint keeps each rank's optimizer state of its flat partition: torch's moments element by element,
or a bitsandbytes optimizer's codes with scales per 256-element block counted from that rank's partition start.
deepspeed_bnb's partitions are block-aligned per parameter, so neither can be handed to its optimizer directly, and the
load refuses it naming `deepspeed-bnb convert`. A run resumed by a framework (HF Trainer's `resume_from_checkpoint`)
has no step where a user could run that command: with the key set, the publishing rank runs the same conversion into
a scratch folder beside the tag, every rank loads it through the ordinary route (manifest, safe loader, resharding to
this engine's DP size and stage), and the scratch folder is removed afterwards, whatever happens. The source is only
read. The conversion requantizes 8-bit moments (within half a quantization step; the printed report gives the worst
case), so it is a setting, never a silent default.
"""

import contextlib
import os
import shutil

from deepspeed import comm as dist

from deepspeed_bnb.checkpoint.format.errors import CheckpointMismatchError
from deepspeed_bnb.checkpoint.tools.convert import HYPERPARAMS, convert

STOCK_SCRATCH = ".{tag}.from-stock.deepspeed_bnb"  # beside the tag, the same path on every rank (and node)


def load_through_scratch(engine, load_dir: str, tag: str, scratch_name: str, write, arguments: dict, agree,
                         publisher: bool, what: str, label: str, command: str, inner=contextlib.nullcontext):
    """Load `load_dir`/`tag` into `engine` through the deepspeed_bnb tag `write(scratch)` writes (run by the
    publisher, inside `agree`; returns a report line) into `load_dir`/`scratch_name`. `label` names the source in the
    printed report; `command`: the offline conversion a user can run instead, named where the write fails; `inner`:
    a context around the scratch tag's own load. Returns what load_checkpoint returns."""
    scratch = os.path.join(load_dir, scratch_name)

    def written():
        if not publisher:
            return None
        if os.path.lexists(scratch):  # left by a load that was killed
            shutil.rmtree(scratch)
        try:
            return write(scratch)
        except OSError as exc:
            raise CheckpointMismatchError(
                f"{exc}: the {label} is rewritten once into {scratch} for this engine (write access to {load_dir} "
                f"and room for one more copy), and that failed. Convert it yourself (`{command}`) and load OUT "
                f"instead.") from exc

    try:
        report = agree(written, context=what)
        if report:
            print(f"deepspeed_bnb: {label} {os.path.join(load_dir, tag)}: {report}", flush=True)
        with inner():
            path, client_state = engine.load_checkpoint(scratch, tag=tag, **arguments)
        return _in_source(path, scratch, load_dir, tag), client_state
    finally:
        dist.barrier()
        if publisher:
            shutil.rmtree(scratch, ignore_errors=True)


def _in_source(path, scratch: str, load_dir: str, tag: str):
    """The load path DeepSpeed returned, named in the source rather than in the scratch folder (gone once the load
    returns): the same file there, or the source's tag directory where the conversion named it differently."""
    if path is None:
        return None
    mapped = os.path.join(load_dir, os.path.relpath(path, scratch))
    return mapped if os.path.exists(mapped) else os.path.join(load_dir, tag)


def _live_hyperparams(engine) -> list:
    """The engine's param groups' hyper-parameters, for an elastic stock source (which keeps none: DeepSpeed's own
    elastic load keeps the loading engine's, and so does this one)."""
    return [{k: v for k, v in group.items() if k in HYPERPARAMS} for group in engine.optimizer.optimizer.param_groups]


def load_stock(engine, load_dir: str, tag: str, arguments: dict, agree, publisher: bool):
    """Load the stock DeepSpeed tag `load_dir`/`tag` (optimizer state included) into `engine`, a bnb ZeRO engine with
    bnb_convert_stock_on_load set. Returns what load_checkpoint returns."""
    bnb_optimizer = engine.optimizer.optimizer
    source = os.path.join(load_dir, tag)
    to = "8bit" if bnb_optimizer.args.optim_bits == 8 else "32bit"
    size = bnb_optimizer.args.min_8bit_size
    command = f"deepspeed-bnb convert {source} OUT --to {to} --min-8bit-size {size}"

    def write(scratch):  # each parameter's precision the engine's own (bnb overrides: HF Trainer's 32-bit embeddings)
        report = convert(source, scratch, to, optimizer_class=type(bnb_optimizer), min_8bit_size=size, progress=False,
                         default_param_groups=_live_hyperparams(engine),
                         eight_bit_by_name=engine.optimizer.bnb.eight_bit_by_name())
        return "converted for this engine's optimizer: " + report.split(": ", 1)[-1]  # not the scratch tag's path

    what = f"load_checkpoint({load_dir!r}, tag={tag!r}) with zero_optimization.bnb_convert_stock_on_load failed: "
    return load_through_scratch(engine, load_dir, tag, STOCK_SCRATCH.format(tag=tag), write, arguments, agree,
                                publisher, what, "stock DeepSpeed checkpoint", command)
