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

Several jobs may load one checkpoint at once (a sweep started from one run): each load's scratch folder has a name of
its own (a token every rank of the job agrees on), and its publisher holds an advisory lock (flock) on it until it is
removed. A scratch folder of the same tag that nobody holds was left by a load that was killed, and is removed; one
that is held belongs to a load running now, and is left alone. Where the file system cannot lock, leftovers are kept
and named in a warning.
"""

import contextlib
import os
import re
import secrets
import warnings

from deepspeed import comm as dist

from deepspeed_bnb.checkpoint.format.errors import CheckpointMismatchError
from deepspeed_bnb.checkpoint.format.publish import remove, try_flock
from deepspeed_bnb.checkpoint.tools.convert import HYPERPARAMS, convert
from deepspeed_bnb.runtime.zero import compat

STOCK_SCRATCH = ".{tag}.from-stock"  # + "." + the load's token + SCRATCH_SUFFIX: beside the tag
SCRATCH_SUFFIX = ".deepspeed_bnb"
_CLAIMING = "-claiming"  # a scratch folder's name until its publisher holds its lock (leftover scans skip it)


def scratch_pattern(prefix: str) -> "re.Pattern":
    """The names of `prefix`'s scratch folders: those of this release (a 16-hex-digit token) and the one fixed name
    that earlier releases used."""
    return re.compile(rf"{re.escape(prefix)}(\.[0-9a-f]{{16}})?{re.escape(SCRATCH_SUFFIX)}")


def _agreed_token() -> str:
    """One random token for this load, rank 0's, on every rank: every node's scratch folder has the same name, and
    another job's load of the same tag another one."""
    everyone = [None] * dist.get_world_size()
    compat.all_gather_object(everyone, secrets.token_hex(8))
    return everyone[0]


def _sweep_leftovers(load_dir: str, prefix: str) -> None:
    """Remove the scratch folders of `prefix` beside the tag that no load holds (left by killed loads); leave those
    a running load holds. Where the file system cannot lock, leave every one and name them in a warning."""
    pattern, unknown = scratch_pattern(prefix), []
    for name in sorted(os.listdir(load_dir)):
        path = os.path.join(load_dir, name)
        if not pattern.fullmatch(name):
            continue
        if os.path.islink(path) or not os.path.isdir(path):
            remove(path)  # never a load's folder: nothing of ours is followed or kept
            continue
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        except FileNotFoundError:  # another load's sweep removed it first
            continue
        try:
            taken = try_flock(fd)
            if taken:
                remove(path)
            elif taken is None:
                unknown.append(path)
        finally:
            os.close(fd)
    if unknown:
        warnings.warn(f"deepspeed_bnb: {', '.join(unknown)}: scratch folders of earlier loads of this checkpoint, left "
                      f"by loads that were killed or in use by a load running now; this file system cannot lock, so "
                      f"they are kept. Remove them when no load of this checkpoint is running.", RuntimeWarning)


def _claim(scratch: str):
    """Create the empty folder `scratch` locked by this process (returns the descriptor holding the lock): made and
    locked under a name the leftover sweep skips, then renamed, so no other load sees it unlocked."""
    claiming = scratch + _CLAIMING
    os.mkdir(claiming)
    fd = os.open(claiming, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        try_flock(fd)  # None (no locks on this file system): the sweep of other loads leaves it alone, and warns
        os.rename(claiming, scratch)
    except BaseException:
        os.close(fd)
        remove(claiming)
        raise
    return fd


def load_through_scratch(engine, load_dir: str, tag: str, prefix: str, write, arguments: dict, agree,
                         publisher: bool, what: str, label: str, command: str, inner=contextlib.nullcontext):
    """Load `load_dir`/`tag` into `engine` through the deepspeed_bnb tag `write(scratch)` writes (run by the
    publisher, inside `agree`; returns a report line) into a scratch folder of this load's own,
    `load_dir`/`prefix`.<token>.deepspeed_bnb/checkpoint. `label` names the source in the printed report; `command`:
    the offline conversion a user can run instead, named where the write fails; `inner`: a context around the scratch
    tag's own load. Returns what load_checkpoint returns."""
    scratch = os.path.join(load_dir, f"{prefix}.{_agreed_token()}{SCRATCH_SUFFIX}")
    # the converted tag's directory inside the folder this load locks (its writer locks the directory it writes)
    target = os.path.join(scratch, "checkpoint")
    held = []  # the publisher's descriptor holding the scratch folder's lock

    def written():
        if not publisher:
            return None
        try:
            _sweep_leftovers(load_dir, prefix)
            held.append(_claim(scratch))
            return write(target)
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
            path, client_state = engine.load_checkpoint(target, tag=tag, **arguments)
        return _in_source(path, target, load_dir, tag), client_state
    finally:
        dist.barrier()
        if publisher:
            remove(scratch)
            for fd in held:  # the lock is dropped after the folder is gone
                os.close(fd)


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
    cls = type(bnb_optimizer)  # its update rule says which state the source must hold (Lion's one, Adam's two)
    command = (f"deepspeed-bnb convert {source} OUT --to {to} --min-8bit-size {size} "
               f"--optimizer-class {cls.__module__}.{cls.__qualname__}")

    def write(scratch):  # each parameter's precision the engine's own (bnb overrides: HF Trainer's 32-bit embeddings)
        report = convert(source, scratch, to, optimizer_class=cls, min_8bit_size=size, progress=False,
                         default_param_groups=_live_hyperparams(engine),
                         eight_bit_by_name=engine.optimizer.bnb.eight_bit_by_name())
        return "converted for this engine's optimizer: " + report.split(": ", 1)[-1]  # not the scratch tag's path

    what = f"load_checkpoint({load_dir!r}, tag={tag!r}) with zero_optimization.bnb_convert_stock_on_load failed: "
    return load_through_scratch(engine, load_dir, tag, STOCK_SCRATCH.format(tag=tag), write, arguments, agree,
                                publisher, what, "stock DeepSpeed checkpoint", command)
