# deepspeed_bnb — two commands for a newcomer on a fresh machine; both create ./.venv on first use:
#   make demo   train a small GPT on 2 CPU ranks with bnb AdamW8bit under DeepSpeed ZeRO-2
#   make test   run the test suite (what CI runs, through .ci/run)
# Variables: PYTHON (interpreter for the venv, default python3), TORCH_INDEX (a pip index holding the CPU build of
# torch, e.g. https://download.pytorch.org/whl/cpu, for machines without a local copy of the wheel).

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.deepspeed_bnb-installed
TORCH_SPEC ?= torch==2.13.0
TORCH_INDEX ?=

.PHONY: demo test test-quick test-frameworks bootstrap libaio clean

bootstrap: $(STAMP)

$(STAMP): setup.py
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@# keep a torch that is already there; otherwise the CPU build (an unpinned torch pulls a multi-GB CUDA build)
	$(BIN)/python -c "import torch" 2>/dev/null || \
		$(BIN)/python -m pip install $(TORCH_SPEC) $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(BIN)/python -m pip install -e ".[test]"
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/deepspeed --num_gpus 2 examples/train.py --deepspeed_config configs/zero2_adamw8bit.json

test: $(STAMP) libaio
	$(BIN)/python -m pytest -q -m "not frameworks" tests

# the training frameworks' own command lines under deepspeed-bnb run (tests/distributed/test_trl_cli.py): minutes
test-frameworks: $(STAMP)
	$(BIN)/python -m pytest -q -m frameworks tests

# NVMe offload (tests/distributed/test_nvme.py) needs libaio for DeepSpeed's async_io op: installed with apt-get where
# we run as root; elsewhere those tests skip, naming the package
libaio:
	@test -f /usr/include/libaio.h || { test "$$(id -u)" = 0 && command -v apt-get >/dev/null && \
		{ apt-get install -y -q libaio-dev >/dev/null 2>&1 || \
		  { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q libaio-dev >/dev/null 2>&1; }; }; } || \
		echo "libaio-dev is not installed and cannot be installed here (needs root and apt-get):" \
		     "the NVMe offload tests will skip; install it with 'apt-get install libaio-dev'"

test-quick: $(STAMP)  # in-process tests only (no ranks, no fresh processes): 3-4 minutes on 2 cores once the
                      # JIT ops are built (the first run builds them: minutes more)
	$(BIN)/python -m pytest -q -m "not multi_rank and not slow and not frameworks" tests

clean:
	rm -rf $(VENV) checkpoints build *.egg-info
