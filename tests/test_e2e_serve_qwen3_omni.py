"""`omni-serve` with vllm-omni 0.26's Qwen3-Omni stages on vLLM 0.26's V2 through the shim, on CPU:
deploy/speech/qwen3-omni-gpu.toml's pipeline (thinker -> talker -> code2wav, the tiny checkpoint of
the published layout) as far as CPU goes.

Runs beside vllm-omni 0.26 on vLLM 0.26 (tests/support/paired_vllm_omni.py); elsewhere it is
skipped, saying why. A text request runs the thinker (vllm-omni's MoE thinker, its layers 0 and 24
captured), vllm-omni's own thinker -> talker hand-over in the server (omni_serve/speech/qwen3_omni.py)
and the talker's prefill; the talker's first decode step is the CPU limit (its code predictor asks
vllm-omni's platform for torch inductor, which vllm-omni 0.26 has no CPU platform to answer), so
the request fails there, at the talker, with a 503, and the server starts the talker's engine
again. The H200 run (deploy/gpu/run_qwen3_omni.sh, its serve part) goes on to audio.
Three engines and three sidecars start: about 90 s on 2 busy cores (in `make test` of such a venv,
as the pipeline test).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from tests.support.paired_vllm_omni import build_tiny_qwen3_omni, paired_pythonpath, skip_unless_paired
from tests.support.serve import serving

pytestmark = pytest.mark.e2e
CPU_LIMIT = "supports_torch_inductor"
RESTART_TIMEOUT_S = 300
ENGINE = ('max_model_len = 256, max_num_seqs = 4, max_num_batched_tokens = 256, dtype = "bfloat16", seed = 0, '
          'enforce_eager = true, kv_cache_memory_bytes = 67108864, limit_mm_per_prompt = { image = 0, video = 0, audio = 0 }')


def _config(work: Path, model: Path) -> Path:
    """deploy/speech/qwen3-omni-gpu.toml's stages, sized for CPU (eager, no device)."""
    path = work / "serve.toml"
    path.write_text(f'''
served_model_name = "qwen3-omni-tiny"
voices = ["chelsie", "ethan", "aiden"]
max_input_chars = 64
speech_prompt = "tests.tiny_models.qwen3_omni:speech_prompt"
talker_prompt = "omni_serve.speech.qwen3_omni:talker_prompt"
register = ["worker_shim.omni_models.registration:register_vllm_omni_models"]
sample_rate = 24000

[stages.thinker]
model = "{model}"
max_tokens = 4
engine = {{ {ENGINE}, hf_overrides = {{ architectures = ["Qwen3OmniMoeThinkerStage"] }} }}
sampling = {{ temperature = 0.0, ignore_eos = true }}
sidecar = {{ hooks = "omni" }}

[stages.talker]
model = "{model}"
max_tokens = 8
engine = {{ {ENGINE}, hf_overrides = "worker_shim.omni_models.qwen3_omni.config:talker_stage_config" }}
sampling = {{ temperature = 0.0, stop_token_ids = [2150] }}
sidecar = {{ hooks = "omni-talker" }}

[stages.code2wav]
model = "{model}"
placeholder_token = 0
engine = {{ {ENGINE}, hf_overrides = {{ architectures = ["Qwen3OmniMoeCode2WavStage"] }} }}
sidecar = {{ hooks = "omni-code2wav", options = {{ chunk_frames = "4", left_context = "4", codebook_size = "2048" }} }}
''')
    return path


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    skip_unless_paired()
    work = tmp_path_factory.mktemp("serve-qwen3-omni")
    env = {"PYTHONPATH": paired_pythonpath(), "VLLM_USE_V2_MODEL_RUNNER": "1", "VLLM_PLUGINS": "omni_sidecar_shim"}
    with serving(work, _config(work, build_tiny_qwen3_omni(work / "model")), env) as srv:
        yield srv


def test_a_text_request_runs_the_thinker_and_vllm_omnis_hand_over_up_to_the_talkers_decode(server):
    status, body, _ = server.post({"input": "Hi there", "voice": "ethan", "response_format": "pcm"})
    assert status == 503, body[:2000]
    message = json.loads(body)["error"]["message"]
    # The thinker stage served the request and its hand-over made the talker's: the failure is the talker's.
    assert "pipeline failed this request: talker: its engine failed the request" in message, message
    log = server.log.read_text(errors="replace")
    assert "talker_mtp" in log and CPU_LIMIT in log, log[-4000:]
    # The server starts the talker's engine again; then it reports healthy.
    deadline = time.monotonic() + RESTART_TIMEOUT_S
    while server.get("/health")[0] != 200:
        assert time.monotonic() < deadline, server.tail()
        time.sleep(1.0)
    _, health = server.get("/health")
    assert json.loads(health)["stages"]["talker"]["engine_restarts"] == 1
