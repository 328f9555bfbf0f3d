"""Crash-safe saves and verified, pickle-free loads of ZeRO checkpoint tags through `engine.save_checkpoint` /
`engine.load_checkpoint`, one outcome on every rank.

engine.py routes bnb optimizers to deepspeed_bnb's ZeRO classes; this module replaces DeepSpeedEngine's checkpoint
entry points (overrides.py installs them) and the three hooks DeepSpeed calls inside a load.

Saves of a bnb engine: every rank writes into a staging directory, under the save directory's lock; the ranks hash
the files, one publishes the tag with its manifest (checkpoint/format/publish.py). A write that fails on one rank
(a full disk) is held until DeepSpeed's own save has reached its closing barrier on every rank, then every rank
raises the same CheckpointSaveError; the staging directory goes, the tags already published stay.

Loads: a bnb engine loading any tag, and any engine loading a tag deepspeed_bnb wrote (it carries a manifest), get:
- the manifest checked (the tag holds exactly its listed files, sizes on every rank, each SHA-256 on one rank, every
  `.pt` file parsed by the safe loader), the model states read and checked, the DP size they claim checked against
  the rank files, and for a bnb engine the optimizer state checked to fit, all before DeepSpeed changes anything;
- DeepSpeed's own reads inside the load made safe: the model states it reads through `checkpoint_engine.load` come
  from the safe loader, the fp32 weights it would rebuild with zero_to_fp32 (ZeRO-3 weights-only loads; it would
  also read `latest` itself, whatever tag was asked for) are the tag's own, read through the safe loader, and every
  other torch.load it makes is forced weights-only with the same allow-list (safe_load.forced_weights_only).
Stock tags loaded by stock engines keep DeepSpeed's behaviour. A bnb engine configured for universal checkpoints loads
them through runtime/universal_load.py, and one with bnb_convert_stock_on_load a stock tag's optimizer state through
runtime/converted_load.py (each written once as a tag of ours, then this route).

Every step before DeepSpeed's own load or after its save that can fail on one rank alone runs inside `agree`: each
rank learns every rank's outcome, and a failure anywhere raises on every rank, instead of leaving the others in the
next collective until the process group times out. No agreed step contains a collective of its own.
"""

import contextlib
import contextvars
import inspect
import os
import shutil
import warnings
from dataclasses import dataclass, field
from typing import Callable, Dict, Optional

import deepspeed
import torch
from deepspeed import comm as dist

from deepspeed_bnb.checkpoint.format.errors import CheckpointMismatchError, CheckpointSaveError, \
    UnsafeCheckpointError
from deepspeed_bnb.checkpoint.format.manifest import LATEST, LATEST_UNIVERSAL, MANIFEST_NAME, UNSAFE_KEY, \
    file_digest, list_files, read_manifest, read_pointer, safe_name, verify
from deepspeed_bnb.checkpoint.format.publish import DirectoryLock, publish, recover_tag, remove, retired_dir, \
    staging_dir
from deepspeed_bnb.checkpoint.format.reader import SavedCheckpoint, check_model_states, check_unlisted, \
    model_states_name, saved_dp
from deepspeed_bnb.checkpoint.format.records import is_record
from deepspeed_bnb.checkpoint.format.safe_load import forced_weights_only, load_file
from deepspeed_bnb.checkpoint.format.sources import FileSource, rank_file_paths
from deepspeed_bnb.checkpoint.format.weights import FROZEN_FRAGMENTS, FROZEN_SHAPES, consolidated_weights, \
    frozen_weights, zero3_slice
from deepspeed_bnb.checkpoint.tools.universal import refuse_for_stock_engine
from deepspeed_bnb.installer import given_kwargs, stock, swapped
from deepspeed_bnb.runtime import recovery_script
from deepspeed_bnb.runtime.converted_load import load_stock
from deepspeed_bnb.runtime.universal_load import load_universal
from deepspeed_bnb.runtime.zero import compat
from deepspeed_bnb.runtime.zero.bnb_partitions import BnbPartitionsMixin

_AGREED_ERRORS = {cls.__name__: cls for cls in (CheckpointMismatchError, UnsafeCheckpointError, CheckpointSaveError)}


def is_bnb_zero(optimizer) -> bool:
    """Whether `optimizer` (an engine's) is one of deepspeed_bnb's ZeRO optimizers."""
    return isinstance(optimizer, BnbPartitionsMixin)


# ---- one outcome on every rank ---------------------------------------------------------------------------------------

def agree(step: Callable, error=CheckpointMismatchError, context: str = ""):
    """Run `step()` on every rank and return its result. If it raises on any rank, every rank raises `error` with
    `context` and the first failing rank's message (an error of deepspeed_bnb's own kind keeps its class, another is
    named by its type), chained on that rank from what it caught. `step` must not contain a collective."""
    try:
        result, caught, failure = step(), None, None
    except Exception as exc:
        result, caught = None, exc
        own = type(exc).__name__ if type(exc) in _AGREED_ERRORS.values() and isinstance(exc, error) else None
        failure = (own, str(exc) if own else f"{type(exc).__name__}: {exc}")
    everyone = [None] * dist.get_world_size()
    compat.all_gather_object(everyone, failure)
    failed = [(rank, f) for rank, f in enumerate(everyone) if f is not None]
    if not failed:
        return result
    rank, (own, message) = failed[0]
    where = "" if dist.get_world_size() == 1 else f"rank {rank}: "
    raise (_AGREED_ERRORS[own] if own else error)(f"{context}{where}{message}") from caught


def _publisher(engine) -> bool:
    """The rank that publishes a tag: rank 0, or local rank 0 of each node with node-local checkpoint storage."""
    return (engine.local_rank if engine.use_node_local_storage() else engine.global_rank) == 0


def _shared_share(engine, items):
    """This rank's share of work over a list every rank sees the same (each item done by exactly one rank)."""
    if engine.use_node_local_storage():  # each node has its own files: its publisher does all of them
        return items if _publisher(engine) else []
    return items[dist.get_rank()::dist.get_world_size()]


# ---- save ------------------------------------------------------------------------------------------------------------

def _check_tag_name(tag: str) -> str:
    if not tag or tag in (".", "..") or tag.startswith(".") or "/" in tag or os.sep in tag or "\0" in tag:
        raise ValueError(f"save_checkpoint(tag={tag!r}): a tag must be a plain directory name (no '/', not starting "
                         f"with '.', which deepspeed_bnb's staging directories use); e.g. 'global_step100'.")
    return tag


class _DeferredWrites:
    """DeepSpeed's `checkpoint_engine.save` for the duration of its save_checkpoint: a write that fails (a full disk,
    a quota) is recorded instead of raised, and this rank's later writes are skipped, so that every rank still
    reaches DeepSpeed's closing barrier; `raise_failure` then reports it, inside `agree`."""

    def __init__(self, save):
        self.save, self.failure = save, None

    def __call__(self, state_dict, path, *args, **kwargs):
        if self.failure is not None:
            return None
        try:
            return self.save(state_dict, path, *args, **kwargs)
        except Exception as exc:
            self.failure = (str(path), exc)
            return None

    def raise_failure(self) -> None:
        if self.failure is None:
            return
        path, exc = self.failure
        try:
            free = shutil.disk_usage(os.path.dirname(path) or ".").free
            space = f"; {free:,} bytes are free on its file system" + (" (the disk is full)" if free < 1 << 20 else "")
        except OSError:
            space = ""
        text = str(exc).splitlines()[0] if str(exc) else ""
        if "unexpected pos" in text:  # torch.save's writer loses the errno
            text += " (torch.save's report of a write the file system refused: a full disk or quota, or a file size " \
                    "limit)"
        raise CheckpointSaveError(f"writing {path} failed ({type(exc).__name__}: {text}){space}") from exc


def save_checkpoint(self, save_dir, tag=None, client_state={}, save_latest=True, exclude_frozen_parameters=False):
    stock_save = stock("DeepSpeedEngine.save_checkpoint")
    if not is_bnb_zero(self.optimizer):
        return stock_save(self, save_dir, tag, client_state, save_latest, exclude_frozen_parameters)
    if compat.is_decoupled(self.checkpoint_engine):
        # DeepSpeed's decoupled writer finishes files in another process, after this call returns: there is no
        # moment at which they can be hashed and published here. (On CPU it fails on its own in 0.19.8: it cannot
        # pickle the state dict's grad-requiring tensors to its writer process, with any optimizer.)
        if not getattr(self, "_bnb_warned_decoupled", False):
            self._bnb_warned_decoupled = True
            warnings.warn("deepspeed_bnb: DeepSpeed's decoupled checkpoint writer is in use: checkpoints are saved "
                          "without deepspeed_bnb's crash-safe publishing and manifest, so a save killed midway can "
                          "leave a partial tag and loading them needs DEEPSPEED_BNB_TRUST_CHECKPOINTS=1. Remove "
                          "checkpoint.writer.decoupled to keep both.", RuntimeWarning)
        return stock_save(self, save_dir, tag, client_state, save_latest, exclude_frozen_parameters)
    if not save_dir:
        raise ValueError(f"save_dir must be a non-empty string, got {save_dir!r}")
    tag = _check_tag_name(str(tag) if tag is not None else f"global_step{self.global_steps}")
    staged, call = staging_dir(save_dir, tag), f"save_checkpoint({save_dir!r}, tag={tag!r})"
    outcome = {"before publishing": f"Nothing was saved on any rank: the checkpoints already in {save_dir} are "
                                    f"untouched",
               "publishing": f"`latest` in {save_dir} still names a complete checkpoint (the previous one; or, for a "
                             f"failure after the new tag took its place, that one)"}
    phase = ["before publishing"]
    lock = DirectoryLock(save_dir) if _publisher(self) else None
    created = []

    def prepare():  # the publisher makes the directories and takes the lock; a killed save's staging goes
        if lock is not None:
            os.makedirs(save_dir, exist_ok=True)
            lock.acquire_for_save(tag)
            remove(staged)
            os.makedirs(staged)
            created.append(staged)

    try:
        for step in (prepare, lambda: _probe_staging(staged)):  # each a collective of its own
            agree(step, CheckpointSaveError, context=f"{call} failed: ")
        writes = _DeferredWrites(compat.with_moe_param_shapes(self, self.checkpoint_engine.save))
        with swapped("CheckpointEngine.save", writes, on=self.checkpoint_engine), \
                swapped("DeepSpeedEngine.zero_nvme_offload_optimizer", not_stock_nvme, on=self):
            stock_save(self, staged, tag, client_state, False, exclude_frozen_parameters)  # ends with a barrier
        agree(writes.raise_failure, CheckpointSaveError, context=f"{call} failed: ")
        tag_dir = os.path.join(staged, tag)
        mine = agree(lambda: {name: file_digest(os.path.join(tag_dir, name))
                              for name in _shared_share(self, list_files(tag_dir))},
                     CheckpointSaveError, context=f"{call} failed while hashing the written files: ")
        everyone = [None] * dist.get_world_size()
        compat.all_gather_object(everyone, mine)
        phase[0] = "publishing"
        agree(lambda: _publish(self, save_dir, tag, everyone, save_latest), CheckpointSaveError,
              context=f"{call} failed while publishing: ")
    except CheckpointSaveError as exc:
        if created:
            remove(staged)
        raise CheckpointSaveError(f"{exc}. {outcome[phase[0]]}.") from exc.__cause__
    except BaseException:
        if created:
            remove(staged)
        raise
    finally:
        if lock is not None:
            lock.release()
    return True


def _probe_staging(staged: str) -> None:
    """This rank can write where its files go (with node-local storage its node's publisher made the directory)."""
    if not os.path.isdir(staged):
        raise FileNotFoundError(f"{staged} does not exist on this rank's file system")
    probe = os.path.join(staged, f".probe-{dist.get_rank()}")
    with open(probe, "w"):
        pass
    os.remove(probe)


def _publish(engine, save_dir: str, tag: str, shares, save_latest: bool) -> None:
    if not _publisher(engine):
        return
    files = {name: digest for share in shares for name, digest in share.items()}
    needs_trust = {name: entry[UNSAFE_KEY] for name, entry in files.items() if UNSAFE_KEY in entry}
    if needs_trust:  # e.g. an object of the caller's own class in client_state
        warnings.warn(f"deepspeed_bnb: tag {tag!r} was saved, but {needs_trust} (from client_state or the lr "
                      f"scheduler) cannot be read by the safe loader: loading it will need "
                      f"DEEPSPEED_BNB_TRUST_CHECKPOINTS=1. Store plain values (numbers, strings, lists, dicts, "
                      f"tensors) there instead.", RuntimeWarning)
    # DeepSpeed's zero_to_fp32.py, copied beside the tag, cannot read a ZeRO-1/2 checkpoint of ours before 0.19.7
    recovery_script.guard(staging_dir(save_dir, tag), engine.zero_optimization_stage(), deepspeed.__version__)
    publish(save_dir, tag, files, engine.optimizer.bnb_description(), save_latest)


# ---- load ------------------------------------------------------------------------------------------------------------

@dataclass
class TagLoad:
    """What one load_checkpoint call established before DeepSpeed's own load ran; the hooks DeepSpeed calls inside the
    load read it (`current_load()`)."""

    load_dir: str  # the directory load_checkpoint was given
    tag: str  # the tag being loaded (from `latest` when none was given)
    model_states_path: str = ""  # the model-states file DeepSpeed reads first ("" for a universal checkpoint)
    model_states: Optional[dict] = None  # its contents, read through the safe loader and checked
    saved_stage: int = 0  # ZeRO stage the tag was written at (0: unknown)
    source: Optional[FileSource] = None  # a bnb engine's optimizer files, checked to fit it
    weights: Optional[Dict] = None  # fp32 weights by name where DeepSpeed would rebuild them with zero_to_fp32
    frozen: Dict = field(default_factory=dict)  # full weights of the engine's frozen parameters the tag holds

    @property
    def tag_dir(self) -> str:
        return os.path.join(self.load_dir, self.tag)


_LOADING: contextvars.ContextVar = contextvars.ContextVar("deepspeed_bnb_tag_load", default=None)


def current_load() -> Optional[TagLoad]:
    """The TagLoad of the load_checkpoint call in progress (None outside one, or for DeepSpeed's own loads)."""
    return _LOADING.get()


def _written_by_deepspeed_bnb(load_dir: str, tag: str) -> bool:
    """The tag carries a manifest (or is the retired copy a killed save of one left): deepspeed_bnb wrote it."""
    return os.path.lexists(os.path.join(load_dir, tag, MANIFEST_NAME)) or \
        os.path.lexists(os.path.join(retired_dir(load_dir, tag), MANIFEST_NAME))


def load_checkpoint(self, load_dir, tag=None, *args, **kwargs):
    stock_load = stock("DeepSpeedEngine.load_checkpoint")
    bnb, universal = is_bnb_zero(self.optimizer), self.load_universal_checkpoint()
    call = inspect.signature(stock_load).bind(self, load_dir, tag, *args, **kwargs)
    call.apply_defaults()
    arguments = {k: v for k, v in call.arguments.items() if k != "self"}
    if bnb and universal:  # DeepSpeed's universal loader cannot cut bnb state: written once as a tag of ours
        arguments.pop("load_dir"), arguments.pop("tag")
        return load_universal(self, load_dir, tag, arguments, agree, _publisher(self))
    pointer = None
    if tag is None:  # read as DeepSpeed reads it; checked as a name once it leads to a tag of ours or a bnb engine
        pointer = os.path.join(load_dir, LATEST_UNIVERSAL if universal else LATEST)
        tag = read_pointer(load_dir, os.path.basename(pointer))
        if tag is None:  # DeepSpeed warns (or raises, for universal) and returns (None, None)
            return stock_load(self, **arguments)
    tag = str(tag)
    if not bnb and not _written_by_deepspeed_bnb(load_dir, tag):
        return stock_load(self, **arguments)  # a stock tag into a stock engine: DeepSpeed's own behaviour
    what = f"load_checkpoint({load_dir!r}, tag={tag!r}) failed: "
    if pointer is not None:  # a tag a file names must stay inside the checkpoint directory
        agree(lambda: safe_name(tag, pointer, "tag", one_component=True), context=what)
    agree(lambda: _recover(self, load_dir, tag), context=what)
    if bnb and self.optimizer.bnb_settings.convert_stock_on_load and _loads_optimizer(arguments) and \
            os.path.isdir(os.path.join(load_dir, tag)) and not _written_by_deepspeed_bnb(load_dir, tag):
        arguments.pop("load_dir"), arguments.pop("tag")
        return load_stock(self, load_dir, tag, arguments, agree, _publisher(self))
    plan = agree(lambda: _prepare(self, load_dir, tag, explicit=pointer is None, universal=universal,
                                  arguments=arguments), context=what)
    if plan.model_states is not None and not _holds_scheduler(plan.model_states) and \
            arguments["load_lr_scheduler_states"] and self.lr_scheduler is not None:
        # converted checkpoints (a plain bnb run, a universal checkpoint without one) hold no scheduler state;
        # DeepSpeed would fail on checkpoint['lr_scheduler'] after loading the weights
        warnings.warn(f"deepspeed_bnb: {plan.tag_dir} holds no lr scheduler state; the engine's scheduler keeps its "
                      f"own (steps from 0). Step it to the checkpoint's step if the schedule matters.", RuntimeWarning)
        arguments["load_lr_scheduler_states"] = False
    arguments["tag"] = tag
    token = _LOADING.set(plan)
    try:
        with _safe_reads(self, plan):
            return stock_load(self, **arguments)
    finally:
        _LOADING.reset(token)


def _loads_optimizer(arguments: dict) -> bool:
    """Whether load_checkpoint's `arguments` load optimizer state (DeepSpeed's rule)."""
    return arguments["load_optimizer_states"] and not arguments["load_module_only"]


def _holds_scheduler(model_states: dict) -> bool:
    """Whether model states hold lr scheduler state (converted checkpoints do not)."""
    return model_states.get("lr_scheduler") is not None


def _recover(engine, load_dir: str, tag: str) -> None:
    """The publisher finishes an overwrite a killed save interrupted (the retired copy back in place)."""
    if not _publisher(engine):
        return
    try:
        recover_tag(load_dir, tag)
    except OSError as exc:
        raise CheckpointMismatchError(
            f"tag {tag!r} was being replaced by a save that was killed: its previous version waits in "
            f"{retired_dir(load_dir, tag)} and cannot be put back ({exc}). Rename that directory to "
            f"{os.path.join(load_dir, tag)} (or make {load_dir} writable) and load again.") from exc


def _prepare(engine, load_dir: str, tag: str, explicit: bool, universal: bool, arguments: dict) -> TagLoad:
    """Everything a load checks and reads before DeepSpeed changes anything (run on every rank, inside agree)."""
    plan = TagLoad(load_dir=load_dir, tag=tag)
    tag_dir = plan.tag_dir
    if not os.path.isdir(tag_dir):  # stock DeepSpeed fails later on a bare assertion about this directory
        named = f"tag {tag!r} was asked for" if explicit else \
            f"{os.path.join(load_dir, LATEST_UNIVERSAL if universal else LATEST)} names tag {tag!r}"
        tags = sorted(n for n in os.listdir(load_dir) if os.path.isdir(os.path.join(load_dir, n))) \
            if os.path.isdir(load_dir) else []
        raise CheckpointMismatchError(f"{named}, but {tag_dir} does not exist. Tags there: {tags}. Pass one of them "
                                      f"as load_checkpoint(..., tag=...), or fix the `latest` file.")
    manifest = read_manifest(tag_dir)
    bnb = is_bnb_zero(engine.optimizer)
    if manifest is not None:
        verify(tag_dir, manifest, _shared_share(engine, sorted(manifest["files"])))
    if universal:  # a stock engine reading deepspeed_bnb's universal export: the files are checked, DeepSpeed reads
        refuse_for_stock_engine(tag_dir)
        return plan
    plan.model_states_path = os.path.join(tag_dir, model_states_name(tag_dir))
    plan.model_states = check_model_states(load_file(plan.model_states_path), plan.model_states_path)
    config = plan.model_states.get("ds_config") or {}
    plan.saved_stage = int((config.get("zero_optimization") or {}).get("stage", 0) or 0) \
        if isinstance(config.get("zero_optimization") or {}, dict) else 0
    dp = saved_dp(plan.model_states, tag_dir, plan.model_states_path)[0]
    loads_optimizer = _loads_optimizer(arguments)
    if manifest is None:  # refused for a deepspeed_bnb checkpoint, warned about for a stock one
        check_unlisted(tag_dir, is_record(_rank_files(engine, load_dir, tag, dp).state(0).get("base_optimizer_state")))
    if bnb and loads_optimizer:
        plan.source = _check_fits(engine, load_dir, tag, dp)
    elif not bnb and loads_optimizer and engine.optimizer is not None:
        record = _rank_files(engine, load_dir, tag, dp).state(0).get("base_optimizer_state")
        if is_record(record):
            raise CheckpointMismatchError(
                f"{tag_dir} holds bitsandbytes optimizer state ({record.get('optimizer_class', '?')}, written by "
                f"deepspeed_bnb), which this engine's {_client_optimizer(engine)} cannot take. Build the engine "
                f"with that bitsandbytes optimizer (it loads at any data-parallel size), load the weights only "
                f"(load_optimizer_states=False), or export the state for torch AdamW with `deepspeed-bnb export "
                f"{tag_dir} OUT --universal`.")
    partitioned = engine.zero_optimization_partition_weights()
    rebuilds = partitioned and not arguments["load_optimizer_states"] and not engine.has_moe_layers
    saved = None
    if rebuilds or (not partitioned and plan.saved_stage == 3):
        saved = SavedCheckpoint(tag_dir)
        plan.weights = consolidated_weights(saved)
    plan.frozen = _frozen_weights(engine, plan, lambda: saved or SavedCheckpoint(tag_dir))
    return plan


def _frozen_weights(engine, plan: TagLoad, checkpoint) -> Dict:
    """Full weights of the engine's frozen parameters, where the load must set them itself: in a ZeRO-3 engine.
    DeepSpeed copies the tag's frozen_param_fragments into each frozen parameter's live slice, and those are the
    saving rank's slices (a ZeRO-3 tag) or whole tensors (a ZeRO-2 tag): a size mismatch at any other DP size or from
    stage 2, after the trained weights were loaded. In a stage-1/2 engine DeepSpeed's module load sets them from the
    whole tensors in `module` (a stage-1/2 tag: this model-parallel rank's file) or from the weights load_checkpoint
    rebuilt (a stage-3 tag). Either way a frozen parameter of another size is refused here, before anything loads."""
    frozen = {name: param for name, param in engine.module.named_parameters() if not param.requires_grad}
    if not frozen:
        return {}
    sliced = plan.saved_stage == 3 and bool(plan.model_states.get(FROZEN_SHAPES))
    held = frozen_weights(checkpoint()) if sliced else \
        plan.model_states["module"] or {}  # None from a pipeline engine (layer files)
    weights = {}
    for name, param in frozen.items():
        numel = getattr(param, "ds_numel", param.numel())
        if name not in held or (plan.saved_stage == 3 and held[name].numel() == 0):
            continue  # not saved (exclude_frozen_parameters), or a stage-3 placeholder: the engine's values stay
        if held[name].numel() != numel:
            raise CheckpointMismatchError(
                f"{plan.model_states_path}: frozen parameter {name!r} has {held[name].numel()} elements there and "
                f"{numel} in this engine's model: the checkpoint is of another model. Build the engine with the model "
                f"it was saved from.")
        weights[name] = held[name]
    return weights if engine.zero_optimization_partition_weights() else {}


def _client_optimizer(engine) -> str:
    optimizer = getattr(engine, "basic_optimizer", None) or engine.optimizer
    return f"{type(optimizer).__module__}.{type(optimizer).__qualname__}"


def _check_fits(engine, load_dir: str, tag: str, dp: int) -> FileSource:
    """The optimizer state and master weights of the tag fit this bnb engine (format, optimizer class, model,
    precisions, layout), checked before DeepSpeed replaces the module weights; returns its files, already open."""
    source = _rank_files(engine, load_dir, tag, dp)
    engine.optimizer.bnb_check_checkpoint(source, True, engine.zero_load_from_fp32_weights())
    return source


def _rank_files(engine, load_dir, tag, dp: int) -> FileSource:
    """The optimizer files of a tag written by `dp` ranks, named as this engine names them (bf16 prefix or not)."""
    return FileSource(rank_file_paths(
        lambda rank, bf16: engine._get_rank_zero_ckpt_name(load_dir, tag, compat.checkpoint_mp_rank(engine), rank,
                                                           bf16),
        dp, engine.bfloat16_enabled()))


@contextlib.contextmanager
def _safe_reads(engine, plan: TagLoad):
    """DeepSpeed's own reads during the load: the model states through `checkpoint_engine.load` (the copy already read
    and checked, other files through the safe loader), the weights zero_to_fp32 would rebuild (the tag's own, read
    through the safe loader), and any other torch.load forced weights-only."""
    known = {os.path.normpath(plan.model_states_path): plan.model_states} if plan.model_states is not None else {}

    def read(path, map_location=None):
        cached = known.get(os.path.normpath(str(path)))
        return dict(cached) if cached is not None else load_file(str(path))

    def rebuilt_weights(checkpoint_dir, *args, **kwargs):  # DeepSpeed passes the load directory, and no tag
        if plan.weights is None:
            plan.weights = consolidated_weights(SavedCheckpoint(plan.tag_dir))
        return dict(plan.weights)

    with forced_weights_only(), swapped("CheckpointEngine.load", read, on=engine.checkpoint_engine), \
            swapped("engine.get_fp32_state_dict_from_zero_checkpoint", rebuilt_weights), \
            (swapped("DeepSpeedEngine.zero_nvme_offload_optimizer", not_stock_nvme, on=engine)
             if is_bnb_zero(engine.optimizer) else contextlib.nullcontext()):
        yield


def not_stock_nvme() -> bool:
    """DeepSpeedEngine.zero_nvme_offload_optimizer during a bnb engine's save and load: the ZeRO checkpoint's records
    hold the NVMe-offloaded state (no copy of the swap folder is saved or restored)."""
    return False


def _load_zero_checkpoint(self, load_dir, tag, load_optimizer_states=True):
    if not is_bnb_zero(self.optimizer):
        return stock("DeepSpeedEngine._load_zero_checkpoint")(self, load_dir, tag, load_optimizer_states)
    # Stock DeepSpeed refuses another DP size unless the checkpoint is universal (which cannot hold bnb state), and in
    # elastic mode every rank reads every file. Our per-rank records describe their own layout, so each new rank reads
    # just the old files overlapping its partition (memory-mapped), at any DP size, elastic flag or not. Everything
    # read here was checked in load_checkpoint (agreed by every rank); the load itself holds collectives.
    plan = current_load()
    source = plan.source if plan is not None and plan.source is not None else None
    if source is None or source.dp != self.loaded_checkpoint_dp_world_size:
        source = _rank_files(self, load_dir, tag, self.loaded_checkpoint_dp_world_size)
    self.optimizer.bnb_load_checkpoint(source, load_optimizer_states, self.zero_load_from_fp32_weights())
    return True


MODEL_STATES_PATTERNS = ("mp_rank_*_model_states.pt", "zero_pp_rank_0_mp_rank_*_model_states.pt")  # stage 1/2, 3


def _get_all_ckpt_names(self, checkpoints_path, tag):
    # At stage 3 every rank reads the model-states file of its own DP rank; a rank that did not exist when the
    # checkpoint was saved (it loads at a larger DP size) has none. Those files differ only in the rank they name (the
    # parameters are partitioned, so the module entries are empty), so such a rank reads rank 0's, as DeepSpeed does
    # for universal checkpoints. A checkpoint of the other stage family (1/2 <-> 3) names its file the other way.
    names = stock("DeepSpeedEngine._get_all_ckpt_names")(self, checkpoints_path, tag)
    if not names and current_load() is not None:
        import glob
        for pattern in MODEL_STATES_PATTERNS[::-1] if self.zero_optimization_partition_weights() else \
                MODEL_STATES_PATTERNS:
            names = sorted(glob.glob(os.path.join(checkpoints_path, str(tag), pattern)))
            if names:
                break
    return names


def load_module_state_dict(self, checkpoint, strict=True, custom_load_fn=None, fetch_z3_params=False,
                           z3_params_to_fetch=None, allowed_missing_keys=None):
    # A checkpoint of the other ZeRO stage family: stage 1/2 files hold full module weights, stage 3 files empty ones
    # (partitioned). Into a stage-3 engine, full weights load as DeepSpeed loads them for module-only loads (gathered,
    # loaded, partitioned again); into a stage-1/2 engine, a stage-3 file's weights are the ones load_checkpoint
    # rebuilt from the rank files through the safe loader (zero_to_fp32 unpickles fully). A bnb engine's fp32 master
    # weights then come from the optimizer records either way. Frozen parameters: see _load_frozen.
    stock_load = stock("DeepSpeedEngine.load_module_state_dict")
    if isinstance(checkpoint, dict) and "module" not in checkpoint and \
            all(torch.is_tensor(value) for value in checkpoint.values()):
        # PipelineEngine.load_module_state_dict hands a checkpoint whose 'module' is a dict (the tags deepspeed_bnb
        # writes offline, with whole weights instead of layer files) on as the module dict itself, where this method
        # reads checkpoint['module'] (DeepSpeed 0.16-0.19: KeyError)
        checkpoint = {"module": checkpoint}
    plan = current_load()
    if plan is not None and custom_load_fn is None and plan.saved_stage:
        partitioned = self.zero_optimization_partition_weights()
        if partitioned and plan.saved_stage < 3:
            fetch_z3_params = True
        elif not partitioned and plan.saved_stage == 3 and plan.weights is not None:
            module = dict(checkpoint["module"])
            for name, param in self.module.named_parameters():
                if name in plan.weights:
                    module[name] = plan.weights[name].to(param.dtype)
            checkpoint["module"] = module
    frozen = {name for name, p in self.module.named_parameters() if not p.requires_grad} \
        if plan is not None and custom_load_fn is None and allowed_missing_keys is None else set()
    if frozen:
        checkpoint = _without_frozen(self, checkpoint, frozen, plan.frozen, strict)
        strict = False  # checked above, the frozen names excepted
    stock_load(self, checkpoint, strict, custom_load_fn, fetch_z3_params,
               **given_kwargs("DeepSpeedEngine.load_module_state_dict", z3_params_to_fetch=z3_params_to_fetch,
                              allowed_missing_keys=allowed_missing_keys))
    for name, param in self.module.named_parameters():
        if name in frozen and name in plan.frozen:
            _load_frozen(param, plan.frozen[name])


def _without_frozen(engine, checkpoint: dict, frozen: set, loaded_here: dict, strict: bool) -> dict:
    """The checkpoint DeepSpeed's load is handed when the engine has frozen parameters: without DeepSpeed's fragments
    of them (see _frozen_weights) and without the entries _load_frozen sets instead (`loaded_here`); the other keys
    checked as a strict load checks them, except that frozen parameters may be missing (a tag saved with
    exclude_frozen_parameters: they keep the engine's values)."""
    module = {name: value for name, value in checkpoint["module"].items() if name not in loaded_here}
    if strict:
        present = set(engine.module.state_dict())
        missing = sorted(present - frozen - set(module) - set(loaded_here))
        unexpected = sorted(set(module) - present)
        if missing or unexpected:
            raise RuntimeError(f"Error(s) in loading state_dict for {type(engine.module).__name__}: missing keys "
                               f"{missing[:10]}, unexpected keys {unexpected[:10]} (frozen parameters aside)")
    return {**{k: v for k, v in checkpoint.items() if k != FROZEN_FRAGMENTS}, "module": module}


def _load_frozen(param, full) -> None:
    """A frozen ZeRO-3 parameter's own slice set from its full saved weights (zero3_slice)."""
    part = param.ds_tensor
    piece = zero3_slice(full.reshape(-1), dist.get_rank(group=param.ds_process_group), part.numel())
    with torch.no_grad():
        part.data.reshape(-1).copy_(piece.to(part.dtype))
