"""deepspeed_bnb: bitsandbytes optimizers as first-class citizens of DeepSpeed ZeRO-1/2/3. Importing it is the setup.

    import deepspeed_bnb   # teaches DeepSpeed the zero_optimization.bnb_* keys and the block-aware optimizer
    engine, *_ = deepspeed.initialize(model=model, optimizer=bnb.optim.AdamW8bit(...), config=cfg)

The import checks the DeepSpeed, bitsandbytes and torch releases (_versions.py) and installs every override of DeepSpeed
listed in deepspeed_bnb/overrides.py. The offline checkpoint tools (`deepspeed-bnb`, deepspeed_bnb_tools.py) import the
package with DEEPSPEED_BNB_OFFLINE=1 instead: neither happens, and DeepSpeed stays exactly as installed. Never set
it for training: a bnb optimizer would then reach stock ZeRO.
"""

import os

from deepspeed_bnb._torch_floor import require_torch_floor

__version__ = "0.1.0"
OFFLINE_ENV = "DEEPSPEED_BNB_OFFLINE"
OFFLINE = os.environ.get(OFFLINE_ENV) == "1"
require_torch_floor()  # the offline tools too: below it no checkpoint loads safely, and torch blames the file


def activate() -> None:
    """Check the installed releases and install the DeepSpeed overrides (idempotent; done by the import)."""
    from deepspeed_bnb import installer, integrations
    from deepspeed_bnb._versions import check_versions
    if not installer.is_active():
        check_versions()
    installer.activate()
    integrations.install_lazily()  # Accelerate's entries, if and when Accelerate is imported


if not OFFLINE:
    activate()
    from deepspeed_bnb.runtime.zero.config import BnbZeroConfig  # noqa: E402,F401
    from deepspeed_bnb.runtime.zero.stage3 import BnbZeroStage3Optimizer  # noqa: E402,F401
    from deepspeed_bnb.runtime.zero.stage_1_and_2 import BnbZeroOptimizer  # noqa: E402,F401
    from deepspeed_bnb.state_layout import BLOCK_SIZE, GroupLayout, ShardedLayout  # noqa: E402,F401
