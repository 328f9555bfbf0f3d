"""The errors a checkpoint read or write raises: each names the file or value at fault and the fix."""


class CheckpointMismatchError(RuntimeError):
    """A checkpoint that does not fit the engine loading it, or that is damaged, malformed or not what it claims."""


class UnsafeCheckpointError(CheckpointMismatchError):
    """A checkpoint file that needs an object outside the safe loader's allow-list to load (it could run code)."""


class CheckpointSaveError(OSError):
    """A save that failed on some rank; every rank raises it, and the checkpoints already published are untouched."""
