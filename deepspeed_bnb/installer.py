"""Installs the override register's replacements (overrides.py) into DeepSpeed and Accelerate, and takes them back.

`activate()` (called by `import deepspeed_bnb`) installs every import-scope replacement of DeepSpeed and keeps
DeepSpeed's originals (`stock(key)`, which the replacements delegate to); Accelerate's are installed when Accelerate
itself is imported (`install_triggered`, from integrations' import hook); `stock_deepspeed()` takes them all back for
a block (comparisons and benchmarks); `swapped()` holds a call-scope swap for a block. `accepts` and `given_kwargs`
read the installed release's signatures (DeepSpeed's original where one is replaced). The replacements are named in
the register by "module:qualname" strings, resolved here only when installed, so that the register imports nothing.
"""

import contextlib
from typing import Dict

from deepspeed_bnb.overrides import BY_KEY, IMPORT_SCOPE, OVERRIDES, REPLACE, SWAP, parameters, resolve

_STOCK: Dict[str, object] = {}  # key -> DeepSpeed's (or Accelerate's) original, for every installed REPLACE entry
_ACTIVE = {"on": False}  # whether activate() installed the import-scope replacements


def installed_entries(trigger: str = ""):
    """The import-scope replacements installed by activate() (trigger "") or by the import of `trigger`."""
    return [o for o in OVERRIDES if o.how == REPLACE and o.scope == IMPORT_SCOPE and o.trigger == trigger]


def stock(key: str):
    """DeepSpeed's original of a replaced symbol (what the replacement delegates to)."""
    return _STOCK[key]


def _set(entries, use_ours: bool) -> None:
    for entry in entries:
        owner = resolve(entry.owner)
        if entry.key not in _STOCK:
            _STOCK[entry.key] = getattr(owner, entry.name)
        setattr(owner, entry.name, resolve(entry.replacement) if use_ours else _STOCK[entry.key])


def activate() -> None:
    """Install every import-scope replacement of DeepSpeed (idempotent). Those of another package (Accelerate) are
    installed by `install_triggered` when that package is imported (deepspeed_bnb/integrations' import hook)."""
    _set(installed_entries(), True)
    _ACTIVE["on"] = True


def install_triggered(trigger: str, module) -> None:
    """Install the replacements of a module that has just been imported (integrations' import hook)."""
    for entry in installed_entries(trigger):
        owner = resolve(entry.owner)
        if getattr(owner, entry.name) is not resolve(entry.replacement):
            _STOCK[entry.key] = getattr(owner, entry.name)
            setattr(owner, entry.name, resolve(entry.replacement))


def is_active() -> bool:
    return _ACTIVE["on"]


@contextlib.contextmanager
def stock_deepspeed():
    """Within this block DeepSpeed is exactly stock: every replacement activate() installed is taken back (for
    comparisons and benchmarks), and put back afterwards."""
    entries = [o for o in OVERRIDES if o.key in _STOCK and o.how == REPLACE]  # Accelerate's too, once installed
    _set(entries, False)
    try:
        yield
    finally:
        _set(entries, True)


@contextlib.contextmanager
def swapped(key: str, value, on=None):
    """Within the block, the SWAP entry `key` holds `value` (on its owner, or on the object `on`)."""
    entry = BY_KEY[key]
    if entry.how != SWAP:
        raise ValueError(f"deepspeed_bnb: {key} is not a call-scope swap in the override register")
    target = resolve(entry.owner) if on is None else on
    had = entry.name in vars(target) if on is not None else True
    previous = getattr(target, entry.name)
    setattr(target, entry.name, value)
    try:
        yield previous
    finally:
        if had:
            setattr(target, entry.name, previous)
        else:
            delattr(target, entry.name)


def accepts(key: str, param: str) -> bool:
    """Whether the installed release's symbol of entry `key` takes `param` (its DeepSpeed original if replaced)."""
    entry = BY_KEY[key]
    func = _STOCK.get(key) or getattr(resolve(entry.owner), entry.name)
    return param in parameters(func)


def given_kwargs(key: str, **kwargs) -> dict:
    """`kwargs` for the installed release's symbol of entry `key`: a parameter it lacks (`params_since` a later
    release) is left out when its value is None (the default everywhere), and refused otherwise."""
    out = {}
    for name, value in kwargs.items():
        if accepts(key, name):
            out[name] = value
        elif value is not None:
            import deepspeed
            raise NotImplementedError(f"deepspeed_bnb: {key}({name}=...) needs DeepSpeed "
                                      f"{BY_KEY[key].params_since.get(name, 'a later release')} or later; "
                                      f"DeepSpeed {deepspeed.__version__} is installed.")
    return out
