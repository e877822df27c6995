# Two commands: `make demo` and `make test`. Both create .venv on first use.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.omni-installed
# What vLLM V2 needs on a CPU-only host (see deploy/cpu/README.md).
export TRITON_INTERPRET ?= 1
export OMP_NUM_THREADS ?= 1
export HF_HUB_OFFLINE ?= 1
export VLLM_USE_V2_MODEL_RUNNER ?= 1
export VLLM_NO_USAGE_STATS ?= 1
export TOKENIZERS_PARALLELISM ?= false

.PHONY: install demo test bench clean

install: $(STAMP)

$(STAMP): pyproject.toml deploy/cpu/install.sh
	PY=$(PY) VENV=$(VENV) sh deploy/cpu/install.sh
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python examples/demo.py

test: $(STAMP)
	$(BIN)/python -m pytest -q -ra

bench: $(STAMP)
	$(BIN)/python -m bench

clean:
	rm -rf $(VENV) .pytest_cache
