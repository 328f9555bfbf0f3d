"""Teaches `deepspeed.runtime.engine.DeepSpeedEngine` to build deepspeed_bnb's ZeRO optimizers for bitsandbytes ones.

`DeepSpeedEngine._configure_zero_optimizer` instantiates `DeepSpeedZeroOptimizer` (stages 1/2) and
`deepspeed.runtime.zero.stage3.DeepSpeedZeroOptimizer_Stage3` by their module-level names; the wrapper installed here
rebinds the name, for the duration of the call only, to BnbZeroOptimizer / BnbZeroStage3Optimizer when the client
optimizer is a bitsandbytes optimizer, and `_load_zero_checkpoint` lets such an engine load its checkpoints
at any data-parallel size; `save_checkpoint` / `load_checkpoint` of such an engine publish tags crash-safely with a
checksummed manifest and verify it on load (checkpoint/manifest.py), read every file through the safe loader
(checkpoint/safe_load.py: no pickled code runs), and check that the optimizer state fits before DeepSpeed replaces any
module weight. Every other optimizer and stage keeps DeepSpeed's behaviour.
Every replaced or swapped DeepSpeed symbol is declared in overrides.py, which installs them;
`stock_deepspeed()` (from there) switches all of them off for a block (comparisons, benchmarks).
"""

import functools
import inspect
import os
import shutil
import warnings

from deepspeed.runtime.zero.config import ZERO_OPTIMIZATION
from deepspeed.runtime.zero.utils import is_zero_supported_optimizer as _stock_is_zero_supported_optimizer

from deepspeed import comm as dist

from deepspeed_bnb.checkpoint.format.errors import CheckpointMismatchError
from deepspeed_bnb.checkpoint.format.manifest import UNSAFE_KEY, file_digest, latest_tag, list_files, read_manifest, \
    verify
from deepspeed_bnb.checkpoint.format.publish import publish, recover_tag, staging_dir
from deepspeed_bnb.checkpoint.format.reader import SavedCheckpoint, check_unlisted, model_states_name
from deepspeed_bnb.checkpoint.format.records import is_record
from deepspeed_bnb.checkpoint.format.safe_load import load_file
from deepspeed_bnb.checkpoint.format.sources import FileSource, rank_file_paths
from deepspeed_bnb.optim.bnb_adapter import is_bnb_optimizer
from deepspeed_bnb.overrides import given_kwargs, stock, stock_deepspeed, swapped  # noqa: F401  (stock_deepspeed: API)
from deepspeed_bnb.runtime.zero import compat
from deepspeed_bnb.runtime.zero import padding_tensors
from deepspeed_bnb.runtime.zero.bnb_partitions import BnbPartitionsMixin
from deepspeed_bnb.runtime.zero.compat import PADDING_TENSORS
from deepspeed_bnb.runtime.zero.config import bnb_settings
from deepspeed_bnb.runtime.zero.stage3 import BnbZeroStage3Optimizer
from deepspeed_bnb.runtime.zero.stage_1_and_2 import BnbZeroOptimizer

# ZeRO stage -> (the override-register key of the module-level name DeepSpeed instantiates, deepspeed_bnb's class)
_ZERO_CLASSES = {1: ("engine.DeepSpeedZeroOptimizer", BnbZeroOptimizer),
                 2: ("engine.DeepSpeedZeroOptimizer", BnbZeroOptimizer),
                 3: ("stage3.DeepSpeedZeroOptimizer_Stage3", BnbZeroStage3Optimizer)}


def _routes_to_bnb(engine, optimizer) -> bool:
    return is_bnb_optimizer(optimizer) and engine.zero_optimization_stage() in _ZERO_CLASSES


def is_bnb_zero(optimizer) -> bool:
    """Whether `optimizer` (an engine's) is one of deepspeed_bnb's ZeRO optimizers."""
    return isinstance(optimizer, BnbPartitionsMixin)


def _configure_optimizer(self, client_optimizer, model_parameters):
    # The swap in _configure_zero_optimizer below is how a bnb optimizer reaches BnbZeroOptimizer. Should a DeepSpeed
    # release build its ZeRO optimizer by another route, stock ZeRO would step bnb on flat partitions (state that
    # depends on the DP size, checkpoints that do not reload) without a word: refuse that here instead.
    stock("DeepSpeedEngine._configure_optimizer")(self, client_optimizer, model_parameters)
    if not _routes_to_bnb(self, client_optimizer):
        return
    stage = self.zero_optimization_stage()
    swap, ours = _ZERO_CLASSES[stage]
    if not isinstance(self.optimizer, ours):
        import deepspeed
        built = type(self.optimizer)
        raise RuntimeError(
            f"deepspeed_bnb: DeepSpeed {deepspeed.__version__} built {built.__module__}.{built.__qualname__} for the "
            f"bitsandbytes optimizer {type(client_optimizer).__name__} under ZeRO stage {stage}, not deepspeed_bnb's "
            f"{ours.__name__}: this DeepSpeed no longer builds its stage-{stage} optimizer through "
            f"DeepSpeedEngine._configure_zero_optimizer and the module-level name deepspeed.runtime.{swap}, which is "
            f"where deepspeed_bnb hooks in. Stock ZeRO would shard bnb's quantization state element-wise. Use a "
            f"DeepSpeed version deepspeed_bnb supports (see its README).")


def _configure_zero_optimizer(self, optimizer):
    configure = stock("DeepSpeedEngine._configure_zero_optimizer")
    if not _routes_to_bnb(self, optimizer):
        return configure(self, optimizer)
    if getattr(self, "zenflow", False):
        raise NotImplementedError(f"deepspeed_bnb: ZenFlow (zero_optimization.zenflow) steps the optimizer with its "
                                  f"own CPU update; it cannot step the bitsandbytes optimizer "
                                  f"{type(optimizer).__name__} block-aware. Remove the zenflow section, or use a "
                                  f"non-bitsandbytes optimizer with ZenFlow.")
    if compat.super_offload(self):
        raise NotImplementedError(f"deepspeed_bnb: SuperOffload (offload_optimizer.super_offload) steps the optimizer "
                                  f"with DeepSpeedCPUAdam; it cannot step the bitsandbytes optimizer "
                                  f"{type(optimizer).__name__}. Remove super_offload.")
    swap, ours = _ZERO_CLASSES[self.zero_optimization_stage()]
    if ours is BnbZeroStage3Optimizer:
        # subclasses DeepSpeed's stage-3 class at import, inside the call below: it must see the real one
        compat.import_superoffload()
    with swapped(swap, functools.partial(ours, **bnb_settings(self._config.zero_config))):
        return configure(self, optimizer)


def _do_optimizer_sanity_check(self, basic_optimizer):
    # With bf16 params, fp32 gradient accumulation and ZeRO-1, DeepSpeed picks BF16_Optimizer, which flattens and
    # partitions bnb state element-wise just like stock ZeRO. DeepSpeedZeroOptimizer supports that combination too
    # (fp32 grad-accumulation attribute), so bnb optimizers go there.
    wrapper = stock("DeepSpeedEngine._do_optimizer_sanity_check")(self, basic_optimizer)
    if self.zero_optimization() and _routes_to_bnb(self, basic_optimizer):
        return ZERO_OPTIMIZATION
    return wrapper


def _load_zero_checkpoint(self, load_dir, tag, load_optimizer_states=True):
    if not is_bnb_zero(self.optimizer):
        return stock("DeepSpeedEngine._load_zero_checkpoint")(self, load_dir, tag, load_optimizer_states)
    # Stock DeepSpeed refuses another DP size unless the checkpoint is universal (which cannot hold bnb state), and in
    # elastic mode every rank reads every file. Our per-rank records describe their own layout, so each new rank reads
    # just the old files overlapping its partition (memory-mapped), at any DP size, elastic flag or not.
    if self.load_universal_checkpoint():
        raise NotImplementedError("deepspeed_bnb: DeepSpeed universal checkpoints cannot hold bitsandbytes state; "
                                  "load the ZeRO checkpoint itself (it loads at any data-parallel size).")
    source = getattr(self, "_bnb_checked_source", None)  # what load_checkpoint validated, files already open
    if source is None or source.dp != self.loaded_checkpoint_dp_world_size:
        source = _rank_files(self, load_dir, tag, self.loaded_checkpoint_dp_world_size)
    self.optimizer.bnb_load_checkpoint(source, load_optimizer_states, self.zero_load_from_fp32_weights())
    return True


def _rank_files(engine, load_dir, tag, dp: int) -> FileSource:
    """The optimizer files of a tag written by `dp` ranks, named as this engine names them (bf16 prefix or not)."""
    return FileSource(rank_file_paths(
        lambda rank, bf16: engine._get_rank_zero_ckpt_name(load_dir, tag, compat.checkpoint_mp_rank(engine), rank,
                                                           bf16),
        dp, engine.bfloat16_enabled()))


MODEL_STATES_PATTERNS = ("mp_rank_*_model_states.pt", "zero_pp_rank_0_mp_rank_*_model_states.pt")  # stage 1/2, 3


def _get_all_ckpt_names(self, checkpoints_path, tag):
    # At stage 3 every rank reads the model-states file of its own DP rank; a rank that did not exist when the
    # checkpoint was saved (it loads at a larger DP size) has none. Those files differ only in the rank they name (the
    # parameters are partitioned, so the module entries are empty), so such a rank reads rank 0's, as DeepSpeed does
    # for universal checkpoints. A checkpoint of the other stage family (1/2 <-> 3) names its file the other way.
    names = stock("DeepSpeedEngine._get_all_ckpt_names")(self, checkpoints_path, tag)
    if not names and is_bnb_zero(self.optimizer):
        import glob
        for pattern in MODEL_STATES_PATTERNS[::-1] if self.zero_optimization_partition_weights() else \
                MODEL_STATES_PATTERNS:
            names = sorted(glob.glob(os.path.join(checkpoints_path, str(tag), pattern)))
            if names:
                break
    return names


def load_module_state_dict(self, checkpoint, strict=True, custom_load_fn=None, fetch_z3_params=False,
                           z3_params_to_fetch=None, allowed_missing_keys=None):
    # A deepspeed_bnb checkpoint loads into another ZeRO stage family: stage 1/2 files hold full module weights,
    # stage 3 files empty ones (partitioned). Into a stage-3 engine, full weights load as DeepSpeed loads them for
    # module-only loads (gathered, loaded, partitioned again); into a stage-1/2 engine, a stage-3 file's weights are
    # rebuilt by DeepSpeed's own zero_to_fp32 from the rank files. The fp32 master weights in the optimizer records
    # then overwrite them either way.
    stock_load = stock("DeepSpeedEngine.load_module_state_dict")
    saved = checkpoint.get("ds_config", {}).get("zero_optimization", {}).get("stage", 0) if isinstance(
        checkpoint.get("ds_config"), dict) else 0
    if is_bnb_zero(self.optimizer) and custom_load_fn is None and saved:
        live_partitioned = self.zero_optimization_partition_weights()
        if live_partitioned and saved < 3:
            fetch_z3_params = True
        elif not live_partitioned and saved == 3 and getattr(self, "_bnb_loading", None):
            # the weights zero_to_fp32 would rebuild, read through the safe loader (zero_to_fp32 unpickles fully)
            from deepspeed_bnb.checkpoint.format.weights import consolidated_weights
            load_dir, tag = self._bnb_loading
            weights = consolidated_weights(SavedCheckpoint(os.path.join(load_dir, str(tag))))
            module = dict(checkpoint["module"])
            for name, param in self.module.named_parameters():
                if name in weights:
                    module[name] = weights[name].to(param.dtype)
            checkpoint["module"] = module
    return stock_load(self, checkpoint, strict, custom_load_fn, fetch_z3_params,
                      **given_kwargs("DeepSpeedEngine.load_module_state_dict", z3_params_to_fetch=z3_params_to_fetch,
                                     allowed_missing_keys=allowed_missing_keys))


def _publisher(engine) -> bool:
    """The rank that publishes a tag: rank 0, or local rank 0 of each node with node-local checkpoint storage."""
    return (engine.local_rank if engine.use_node_local_storage() else engine.global_rank) == 0


def _shared_share(engine, items):
    """This rank's share of work over a list every rank sees the same (each item done by exactly one rank)."""
    if engine.use_node_local_storage():  # each node has its own files: its publisher does all of them
        return items if _publisher(engine) else []
    return items[dist.get_rank()::dist.get_world_size()]


def _collective_check(check, catch=(CheckpointMismatchError,), raise_as=None) -> None:
    """Run `check` on every rank; if any rank fails, every rank raises the first failing rank's error (its class, or
    `raise_as(message)`): loads and saves fail together instead of leaving the other ranks waiting in a collective
    until the launcher kills them."""
    try:
        check()
        error = None
    except catch as exc:
        error = (type(exc), f"{exc}" if dist.get_world_size() == 1 else f"rank {dist.get_rank()}: {exc}")
    errors = [None] * dist.get_world_size()
    compat.all_gather_object(errors, error)
    failed = [e for e in errors if e]
    if failed:
        cls, message = failed[0]
        raise (raise_as or cls)(message)


class CheckpointSaveError(OSError):
    """A save that could not start (on any rank); every rank raises it and the previous checkpoint is untouched."""


def _create_staging(engine, save_dir: str, staged: str) -> None:
    if _publisher(engine):
        os.makedirs(save_dir, exist_ok=True)
        shutil.rmtree(staged, ignore_errors=True)  # left by a save that was killed
        os.makedirs(staged)


def _probe_staging(staged: str) -> None:
    """This rank can write where its files go (with node-local storage its node's publisher made the directory)."""
    if not os.path.isdir(staged):
        raise FileNotFoundError(f"{staged} does not exist on this rank's file system")
    probe = os.path.join(staged, f".probe-{dist.get_rank()}")
    with open(probe, "w"):
        pass
    os.remove(probe)


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
    tag = str(tag) if tag is not None else f"global_step{self.global_steps}"
    staged = staging_dir(save_dir, tag)
    for step in (lambda: _create_staging(self, save_dir, staged), lambda: _probe_staging(staged)):
        # each a collective of its own: a rank that fails must not skip a collective the others are in
        _collective_check(step, catch=(OSError,), raise_as=lambda message: CheckpointSaveError(
            f"save_checkpoint({save_dir!r}, tag={tag!r}) cannot write there: {message}. Nothing was saved on any "
            f"rank and the checkpoints already in that directory are untouched; fix the permissions or free "
            f"space, or pass another save_dir."))
    stock_save(self, staged, tag, client_state, False, exclude_frozen_parameters)  # returns after its closing barrier
    tag_dir = os.path.join(staged, tag)
    mine = {name: file_digest(os.path.join(tag_dir, name)) for name in _shared_share(self, list_files(tag_dir))}
    everyone = [None] * dist.get_world_size()
    compat.all_gather_object(everyone, mine)
    if _publisher(self):
        files = {name: digest for share in everyone for name, digest in share.items()}
        needs_trust = {name: entry[UNSAFE_KEY] for name, entry in files.items() if UNSAFE_KEY in entry}
        if needs_trust:  # e.g. an object of the caller's own class in client_state
            warnings.warn(f"deepspeed_bnb: tag {tag!r} was saved, but {needs_trust} (from client_state or the lr "
                          f"scheduler) cannot be read by the safe loader: loading it will need "
                          f"DEEPSPEED_BNB_TRUST_CHECKPOINTS=1. Store plain values (numbers, strings, lists, dicts, "
                          f"tensors) there instead.", RuntimeWarning)
        publish(save_dir, tag, files, self.optimizer.bnb_description(), save_latest)
    dist.barrier()
    return True


def _check_tag(engine, load_dir, tag, explicit) -> None:
    """The tag exists and its files are whole (manifest: sizes on every rank, each SHA-256 on exactly one rank)."""
    tag_dir = os.path.join(load_dir, str(tag))
    if not os.path.isdir(tag_dir):  # stock DeepSpeed fails later on a bare assertion about this directory
        named = (f"{os.path.join(load_dir, 'latest')} names tag {tag!r}" if explicit is None
                 else f"tag {tag!r} was asked for")
        raise CheckpointMismatchError(
            f"{named}, but {tag_dir} does not exist. Tags there: "
            f"{sorted(n for n in os.listdir(load_dir) if os.path.isdir(os.path.join(load_dir, n)))}. Pass "
            f"one of them as load_checkpoint(..., tag=...), or fix the `latest` file.")
    manifest = read_manifest(tag_dir)
    if manifest is not None:
        verify(tag_dir, manifest, _shared_share(engine, sorted(manifest["files"])))
    else:  # refused for a deepspeed_bnb checkpoint, warned about for a stock one
        check_unlisted(tag_dir, is_record(_rank_files(engine, load_dir, tag, 1).state(0).get("base_optimizer_state")))


def _saved_model_states(load_dir, tag) -> dict:
    """The tag's model-states file (the one DeepSpeed reads first), memory-mapped through the safe loader."""
    tag_dir = os.path.join(load_dir, str(tag))
    return load_file(os.path.join(tag_dir, model_states_name(tag_dir)), mmap=True)


def _holds_scheduler(saved: dict) -> bool:
    """Whether model states hold lr scheduler state (converted checkpoints do not)."""
    return saved.get("lr_scheduler") is not None


def _check_fits(engine, load_dir, tag, saved: dict) -> None:
    """The optimizer state and master weights of the tag fit this engine (format, optimizer class, model,
    precisions, layout), checked before DeepSpeed replaces the module weights. `saved`: its model states."""
    source = _rank_files(engine, load_dir, tag, int(saved.get("dp_world_size") or 1))
    engine.optimizer.bnb_check_checkpoint(source, True, engine.zero_load_from_fp32_weights())
    engine._bnb_checked_source = source


def _safe_reads(engine):
    """DeepSpeed reads the model-states file through `engine.checkpoint_engine.load` (full pickle): route it through
    the safe loader for the duration of a load."""
    return swapped("CheckpointEngine.load", lambda path, map_location=None: load_file(path, map_location=map_location),
                   on=engine.checkpoint_engine)


def load_checkpoint(self, load_dir, tag=None, *args, **kwargs):
    stock_load = stock("DeepSpeedEngine.load_checkpoint")
    if not is_bnb_zero(self.optimizer) or self.load_universal_checkpoint():
        return stock_load(self, load_dir, tag, *args, **kwargs)
    call = inspect.signature(stock_load).bind(self, load_dir, tag, *args, **kwargs)
    call.apply_defaults()
    explicit = tag
    if tag is None:
        tag = latest_tag(load_dir)
    if tag is not None:
        if _publisher(self):
            recover_tag(load_dir, str(tag))
        dist.barrier()
        _collective_check(lambda: _check_tag(self, load_dir, tag, explicit))
        saved = {}
        _collective_check(lambda: saved.update(_saved_model_states(load_dir, tag)))
        if call.arguments["load_optimizer_states"] and not call.arguments["load_module_only"]:  # DeepSpeed's rule
            _collective_check(lambda: _check_fits(self, load_dir, tag, saved))  # for calling _load_zero_checkpoint
        if call.arguments["load_lr_scheduler_states"] and self.lr_scheduler is not None and \
                not _holds_scheduler(saved):
            # converted checkpoints (a plain bnb run, a universal checkpoint without one) hold no scheduler state;
            # DeepSpeed would fail on checkpoint['lr_scheduler'] after loading the weights
            warnings.warn(f"deepspeed_bnb: {os.path.join(load_dir, str(tag))} holds no lr scheduler state; the "
                          f"engine's scheduler keeps its own (steps from 0). Step it to the checkpoint's step if "
                          f"the schedule matters.", RuntimeWarning)
            call.arguments["load_lr_scheduler_states"] = False
    self._bnb_loading = (load_dir, tag)  # for load_module_state_dict, which DeepSpeed does not tell
    arguments = {k: v for k, v in call.arguments.items() if k != "self"}
    try:
        with _safe_reads(self):
            return stock_load(self, **arguments)
    finally:
        self._bnb_loading = None
        self._bnb_checked_source = None


def _get_zero_param_shapes(self):
    # The model states name the model's parameters; DeepSpeed names every entry of the optimizer's flat lists, which
    # on releases without per-parameter padding also hold deepspeed_bnb's padding tensors (runtime/zero/
    # padding_tensors.py): hide those for the call, so the file is the same on every release.
    shapes = stock("DeepSpeedEngine._get_zero_param_shapes")
    if isinstance(self.optimizer, BnbZeroOptimizer) and self.optimizer.bnb_padding_mode == PADDING_TENSORS:
        with padding_tensors.hidden(self.optimizer):
            return shapes(self)
    return shapes(self)


def _is_zero_supported_optimizer(optimizer):
    # Any bnb optimizer, custom subclasses included: their state is classified key by key (state_classes.py), so
    # `zero_allow_untested_optimizer` is not needed.
    return is_bnb_optimizer(optimizer) or _stock_is_zero_supported_optimizer(optimizer)
