import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# What V2 needs on this CPU-only machine (the Makefile exports the same).
for key, value in {
    "TRITON_INTERPRET": "1",
    "OMP_NUM_THREADS": "1",
    "HF_HUB_OFFLINE": "1",
    "VLLM_USE_V2_MODEL_RUNNER": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "TOKENIZERS_PARALLELISM": "false",
}.items():
    os.environ.setdefault(key, value)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    from omni_sidecar.testing import build_tiny_llama

    return str(build_tiny_llama(tmp_path_factory.mktemp("tiny-llama")))


@pytest.fixture
def endpoint(tmp_path_factory) -> str:
    d = tmp_path_factory.mktemp("sock")
    return f"ipc://{d}/sidecar.sock"
