"""deepspeed_bnb: bitsandbytes optimizers as first-class citizens of DeepSpeed ZeRO-1/2/3. Importing it is the setup.

    import deepspeed_bnb   # teaches DeepSpeed the zero_optimization.bnb_* keys and the block-aware optimizer
    engine, *_ = deepspeed.initialize(model=model, optimizer=bnb.optim.AdamW8bit(...), config=cfg)
"""

from deepspeed_bnb._versions import check_versions

check_versions()

from deepspeed_bnb import integrations as _integrations  # noqa: E402  (after the version check, by design)
from deepspeed_bnb.runtime import engine as _engine  # noqa: E402
from deepspeed_bnb.runtime.zero import config as _zero_config  # noqa: E402
from deepspeed_bnb.runtime.zero import partition_parameters as _zero3_partitions  # noqa: E402
from deepspeed_bnb.runtime.zero.config import BnbZeroConfig  # noqa: E402,F401
from deepspeed_bnb.runtime.zero.stage3 import BnbZeroStage3Optimizer  # noqa: E402,F401
from deepspeed_bnb.runtime.zero.stage_1_and_2 import BnbZeroOptimizer  # noqa: E402,F401
from deepspeed_bnb.state_layout import BLOCK_SIZE, GroupLayout, ShardedLayout  # noqa: E402,F401
from deepspeed_bnb.utils import tensor_fragment as _tensor_fragment  # noqa: E402

__version__ = "0.1.0"

_zero_config.install()
_engine.install()
_zero3_partitions.install()  # block-aligned ZeRO-3 partitions, for the parameters a bnb optimizer marks
_tensor_fragment.install()  # safe_{get,set}_local_optimizer_state for ZeRO-1/2 bnb parameters
_integrations.install_lazily()  # Accelerate, if and when it is imported
