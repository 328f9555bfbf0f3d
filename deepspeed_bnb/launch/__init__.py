"""Turning deepspeed_bnb on for a command one does not own (`deepspeed-bnb run -- COMMAND`): wrapper.py starts the
command, deepspeed_bnb/bootstrap/sitecustomize.py activates the package in each of its Python processes (with
after_import.py's hook)."""

RUN_ENV = "DEEPSPEED_BNB_RUN"  # "1" in every process `deepspeed-bnb run` starts (bootstrap/sitecustomize.py reads it)
