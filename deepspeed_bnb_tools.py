"""`deepspeed-bnb` / `python -m deepspeed_bnb_tools`: the offline checkpoint tools, without DeepSpeed's runtime.

The tools (inspect, reshape, export, convert, migrate, kernels) read and write checkpoint files; they need no
override of DeepSpeed and no runtime version check, so the package is imported in its offline mode (see
deepspeed_bnb/__init__.py): DeepSpeed's classes stay exactly as installed, and any DeepSpeed release the files can be
read with will do (none at all for the verbs that read no DeepSpeed object). A module of its own because the mode must
be chosen before the package's first import.
"""

import os
import sys


def main(argv=None):
    os.environ["DEEPSPEED_BNB_OFFLINE"] = "1"  # read once, by the package's import just below
    try:
        from deepspeed_bnb.cli import main as cli_main
    finally:
        os.environ.pop("DEEPSPEED_BNB_OFFLINE", None)  # processes this one starts are not offline
    return cli_main(argv)


if __name__ == "__main__":
    sys.exit(main())
