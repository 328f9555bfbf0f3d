"""Shape-only (fake) implementations of deepspeed_bnb's operators, for torch.compile / opcheck tracing."""

import torch


@torch.library.register_fake("deepspeed_bnb::adam8bit_step_")
def _adam8bit_step_fake(params, grads, codes1, codes2, absmax1, absmax2, state1, state2, qmap1, qmap2, segments,
                        hyper, inv_scale, lp_params=None):
    return None  # updates its arguments in place; nothing to allocate


@torch.library.register_fake("deepspeed_bnb::lion8bit_step_")
def _lion8bit_step_fake(params, grads, codes1, absmax1, state1, qmap1, segments, hyper, inv_scale, lp_params=None):
    return None  # updates its arguments in place; nothing to allocate


@torch.library.register_fake("deepspeed_bnb::momentum8bit_step_")
def _momentum8bit_step_fake(params, grads, codes1, absmax1, state1, qmap1, segments, hyper, inv_scale,
                            lp_params=None):
    return None  # updates its arguments in place; nothing to allocate
