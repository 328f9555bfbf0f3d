"""The errors a checkpoint read or write raises: each names the file or value at fault and the fix."""

TRUST_ENV = "DEEPSPEED_BNB_TRUST_CHECKPOINTS"
"""Set to 1 to load checkpoint files with full pickle (arbitrary code), for checkpoints you trust. Off by default."""


class CheckpointMismatchError(RuntimeError):
    """A checkpoint that does not fit the engine loading it, or that is damaged, malformed or not what it claims."""


class UnsafeCheckpointError(CheckpointMismatchError):
    """A checkpoint file that needs an object outside the safe loader's allow-list to load (it could run code)."""


class CheckpointSaveError(OSError):
    """A save that failed on some rank; every rank raises it, and the checkpoints already published are untouched."""


def refusal(path: str, what: str) -> str:
    """UnsafeCheckpointError's message: the file, what it needs, why that is refused, and the ways out."""
    return (f"{path} needs {what} to load, which deepspeed_bnb's safe loader does not allow: loading it would let "
            f"the file run code or allocate memory out of proportion to its size. deepspeed_bnb checkpoints never "
            f"need it, so this file was written by another tool or tampered with. If you trust this checkpoint (you "
            f"or someone you trust wrote it), set {TRUST_ENV}=1 for this load (or pass --trust to deepspeed-bnb), or "
            f"rewrite it once in the safe format with `deepspeed-bnb migrate SRC DST --trust`.")
