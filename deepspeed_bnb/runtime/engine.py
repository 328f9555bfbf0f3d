"""Teaches `deepspeed.runtime.engine.DeepSpeedEngine` to build deepspeed_bnb's ZeRO optimizers for bitsandbytes ones.

`DeepSpeedEngine._configure_zero_optimizer` instantiates `DeepSpeedZeroOptimizer` (stages 1/2) and
`deepspeed.runtime.zero.stage3.DeepSpeedZeroOptimizer_Stage3` by their module-level names; the wrapper installed here
rebinds the name, for the duration of the call only, to BnbZeroOptimizer / BnbZeroStage3Optimizer when the client
optimizer is a bitsandbytes optimizer. Every other optimizer and stage keeps DeepSpeed's behaviour. How such an engine
saves and loads checkpoints is runtime/checkpointing.py's.
Every replaced or swapped DeepSpeed symbol is declared in overrides.py, which installs them;
`stock_deepspeed()` (from there) switches all of them off for a block (comparisons, benchmarks).
"""

import functools
import os

from deepspeed import comm as dist
from deepspeed.utils import logger
from deepspeed.runtime.zero.config import ZERO_OPTIMIZATION
from deepspeed.runtime.zero.utils import is_zero_supported_optimizer as _stock_is_zero_supported_optimizer

from deepspeed_bnb.optim.bnb_adapter import is_bnb_optimizer
from deepspeed_bnb.installer import stock, stock_deepspeed, swapped  # noqa: F401  (stock_deepspeed: API)
from deepspeed_bnb.launch import RUN_ENV, frameworks
from deepspeed_bnb.runtime.model_parallel import place_of, unsaved_tied_tensors
from deepspeed_bnb.runtime.zero import compat
from deepspeed_bnb.runtime.zero import padding_tensors
from deepspeed_bnb.runtime.zero.compat import PADDING_TENSORS
from deepspeed_bnb.runtime.zero.config import BnbSettings
from deepspeed_bnb.runtime.zero.stage3 import BnbZeroStage3Optimizer
from deepspeed_bnb.runtime.zero.stage_1_and_2 import BnbZeroOptimizer

# ZeRO stage -> (the override-register key of the module-level name DeepSpeed instantiates, deepspeed_bnb's class)
_ZERO_CLASSES = {1: ("engine.DeepSpeedZeroOptimizer", BnbZeroOptimizer),
                 2: ("engine.DeepSpeedZeroOptimizer", BnbZeroOptimizer),
                 3: ("stage3.DeepSpeedZeroOptimizer_Stage3", BnbZeroStage3Optimizer)}


def _routes_to_bnb(engine, optimizer) -> bool:
    return is_bnb_optimizer(optimizer) and engine.zero_optimization_stage() in _ZERO_CLASSES


def _configure_optimizer(self, client_optimizer, model_parameters):
    # The swap in _configure_zero_optimizer below is how a bnb optimizer reaches BnbZeroOptimizer. Should a DeepSpeed
    # release build its ZeRO optimizer by another route, stock ZeRO would step bnb on flat partitions (state that
    # depends on the DP size, checkpoints that do not reload) without a word: refuse that here instead.
    stock("DeepSpeedEngine._configure_optimizer")(self, client_optimizer, model_parameters)
    if not _routes_to_bnb(self, client_optimizer):
        _say_not_routed(self, client_optimizer)
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
            f"DeepSpeed version deepspeed_bnb supports (listed in its docs/versions.md).")


_said = set()  # what `deepspeed-bnb run` said in this process ("routed", "not routed"): each once


def _say_once(what: str) -> bool:
    """Whether to say `what` now: under `deepspeed-bnb run` (a command that asked for deepspeed_bnb without importing
    it, where the log is the user's only sign of it), on rank 0, once per process. A warning, as frameworks quiet
    DeepSpeed's logger below that (HF's Trainer sets it to the process log level)."""
    if os.environ.get(RUN_ENV) != "1" or what in _said or dist.get_rank() != 0:
        return False
    _said.add(what)
    return True


def _say_routed(engine, client_optimizer, built) -> None:
    if _say_once("routed"):
        client = type(client_optimizer)
        logger.warning(f"deepspeed-bnb run: deepspeed_bnb's {type(built).__name__} steps "
                       f"{client.__module__}.{client.__qualname__}'s state under ZeRO stage "
                       f"{engine.zero_optimization_stage()} (partitioned in whole 256-element quantization blocks; "
                       f"checkpoints load at any number of ranks).")
        untested = frameworks.untested_release()
        if untested is not None:
            logger.warning(untested)


def _say_not_routed(engine, client_optimizer) -> None:
    """Say once that an engine's optimizer is left to DeepSpeed, and why (the user may expect 8-bit ZeRO state)."""
    if not _say_once("not routed"):
        return
    name = type(client_optimizer).__name__ if client_optimizer is not None else \
        f"the DeepSpeed config's optimizer ({type(getattr(engine, 'basic_optimizer', None)).__name__})"
    why = ("ZeRO is off (zero_optimization.stage 0)" if is_bnb_optimizer(client_optimizer) else
           f"{name} is not a bitsandbytes optimizer")
    logger.warning(f"deepspeed-bnb run: deepspeed_bnb is active but leaves this engine to DeepSpeed: {why}. Choose a "
                   f"bitsandbytes 8-bit optimizer (e.g. optim adamw_bnb_8bit) with ZeRO stage 1, 2 or 3 for 8-bit "
                   f"state that loads at any size.")


def _configure_zero_optimizer(self, optimizer):
    configure = stock("DeepSpeedEngine._configure_zero_optimizer")
    if not _routes_to_bnb(self, optimizer):
        return configure(self, optimizer)
    name = type(optimizer).__name__
    if getattr(self, "zenflow", False):
        raise NotImplementedError(
            f"deepspeed_bnb: ZenFlow (zero_optimization.zenflow) steps with the ZenFlowCPUAdam DeepSpeed builds from "
            f"the config's \"optimizer\" section and takes no client optimizer (stock DeepSpeed fails at initialize "
            f"with any, torch AdamW included); the bitsandbytes optimizer {name} can only be a client optimizer. "
            f"Remove the zenflow section: CPU offload (offload_optimizer.device \"cpu\") keeps the 8-bit state.")
    if compat.super_offload(self):
        raise NotImplementedError(
            f"deepspeed_bnb: SuperOffload (offload_optimizer.super_offload) steps with its own CPU Adam, built from "
            f"the param groups' hyperparameters whatever the client optimizer is (a torch AdamW client is replaced "
            f"silently; {name}'s groups fail it): it cannot step the bitsandbytes optimizer {name}. Remove "
            f"super_offload: CPU offload (offload_optimizer.device \"cpu\") keeps the 8-bit state.")
    hpz = int(getattr(self._config.zero_config, "zero_hpz_partition_size", 1) or 1)
    if self.zero_optimization_stage() == 3 and hpz > 1 and not compat.partitions_empty_secondary_chunks():
        import deepspeed
        raise NotImplementedError(
            f"deepspeed_bnb: ZeRO++ hpZ (zero_optimization.zero_hpz_partition_size {hpz}) with the bitsandbytes "
            f"optimizer {name} needs DeepSpeed 0.19.5 or later; DeepSpeed {deepspeed.__version__}'s hpZ "
            f"partitioning fails (IndexError in Init._partition_param_sec) on the 256-element block padding of the "
            f"parameters bnb steps. Upgrade DeepSpeed, or remove zero_hpz_partition_size.")
    offload = self._config.zero_config.offload_optimizer
    if self.zero_optimization_stage() < 3 and getattr(offload, "device", None) == "nvme":
        # DeepSpeed's ZeRO-1/2 take any offload device as CPU offload (cpu_offload = device in (cpu, nvme))
        logger.warning("deepspeed_bnb: offload_optimizer.device \"nvme\" at ZeRO stage "
                       f"{self.zero_optimization_stage()}: DeepSpeed's stages 1 and 2 keep the optimizer state in "
                       f"host memory (CPU offload), nothing goes to {offload.nvme_path}. NVMe offload is ZeRO-3's "
                       f"(zero_optimization.stage 3).")
    for module, names in unsaved_tied_tensors(self.module).items():
        # upstream behaviour (stock DeepSpeed loses them too): said here, where it can still be changed
        logger.warning(f"deepspeed_bnb: the pipeline's tied module {module!r} is used only through TiedLayerSpecs with "
                       f"a forward_fn, and DeepSpeed's PipelineModule writes no layer file for such a module: its "
                       f"frozen parameters and buffers {names} are in no checkpoint, and a load keeps the loading "
                       f"engine's values (its trained parameters come back from the optimizer's master weights). "
                       f"Give one of its TiedLayerSpecs no forward_fn (DeepSpeed then runs the module's own forward "
                       f"there and saves it), or restore these tensors yourself after a load.")
    swap, ours = _ZERO_CLASSES[self.zero_optimization_stage()]
    if ours is BnbZeroStage3Optimizer:
        # subclasses DeepSpeed's stage-3 class at import, inside the call below: it must see the real one
        compat.import_superoffload()
    # DeepSpeed builds its ZeRO optimizer itself, by this name: the settings reach ours as one typed argument
    with swapped(swap, functools.partial(ours, bnb_settings=BnbSettings.of(self._config.zero_config),
                                         bnb_model_parallel=place_of(self))):
        built = configure(self, optimizer)
    _say_routed(self, optimizer, built)
    return built


def _do_optimizer_sanity_check(self, basic_optimizer):
    # With bf16 params, fp32 gradient accumulation and ZeRO-1, DeepSpeed picks BF16_Optimizer, which flattens and
    # partitions bnb state element-wise just like stock ZeRO. DeepSpeedZeroOptimizer supports that combination too
    # (fp32 grad-accumulation attribute), so bnb optimizers go there.
    wrapper = stock("DeepSpeedEngine._do_optimizer_sanity_check")(self, basic_optimizer)
    if self.zero_optimization() and _routes_to_bnb(self, basic_optimizer):
        return ZERO_OPTIMIZATION
    return wrapper


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
