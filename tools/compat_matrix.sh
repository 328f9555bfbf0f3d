#!/usr/bin/env bash
# The compatibility matrix (tools/compat_matrix.py): core correctness tests against DeepSpeed x bitsandbytes releases,
# each in a throwaway venv; writes tools/compat_matrix.md. Run by hand, not by `make test`. --help for the options.
set -euo pipefail
cd "$(dirname "$0")/.."
exec "${PYTHON:-python3}" tools/compat_matrix.py "$@"
