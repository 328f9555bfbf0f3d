"""The bitsandbytes optimizers the tests drive, each with small params kept fp32 (min_8bit_size=1000)."""

import bitsandbytes as bnb

M = dict(min_8bit_size=1000)
FACTORIES = {
    "AdamW8bit": lambda p: bnb.optim.AdamW8bit(p, lr=1e-3, weight_decay=0.05, **M),
    "Adam8bit": lambda p: bnb.optim.Adam8bit(p, lr=1e-3, **M),
    "Lion8bit": lambda p: bnb.optim.Lion8bit(p, lr=1e-4, weight_decay=0.1, **M),
    "SGD8bit_momentum": lambda p: bnb.optim.SGD8bit(p, lr=1e-2, momentum=0.9, **M),
    "RMSprop8bit": lambda p: bnb.optim.RMSprop8bit(p, lr=1e-3, **M),
    "Adagrad8bit": lambda p: bnb.optim.Adagrad8bit(p, lr=1e-2, **M),
    "AdEMAMix8bit": lambda p: bnb.optim.AdEMAMix8bit(p, lr=1e-3, t_alpha=10, t_beta3=10, **M),
    "LAMB8bit": lambda p: bnb.optim.LAMB8bit(p, lr=1e-3, **M),
    "LARS8bit": lambda p: bnb.optim.LARS8bit(p, lr=1e-2, momentum=0.9, **M),
    "AdamW_32bit": lambda p: bnb.optim.AdamW(p, lr=1e-3, **M),
    "Lion_32bit": lambda p: bnb.optim.Lion(p, lr=1e-4, **M),
}
