"""`omni-serve` with vllm-omni 0.26's Qwen3-Omni stages on vLLM 0.26's V2 through the shim, on CPU:
deploy/speech/qwen3-omni-gpu.toml's pipeline (thinker -> talker -> code2wav, the tiny checkpoint of
the published layout), sized for CPU.

Runs beside vllm-omni 0.26 on vLLM 0.26 (tests/support/paired_vllm_omni.py); elsewhere it is
skipped, saying why. A text request runs the thinker (vllm-omni's MoE thinker, its layers 0 and 24
captured), vllm-omni's own thinker -> talker hand-over in the server (omni_serve/speech/qwen3_omni.py),
the talker (its code predictor eager on the shim's CPU platform for vllm-omni,
worker_shim/omni_models/cpu_platform.py) and code2wav: the audio of the talker's codes.
The code2wav part on its own: the server's code2wav part
(tests/support/qwen3_omni_code2wav_job.py: a chunk request per chunk, a one-frame first chunk, left
context) on vllm-omni's code2wav stage gives, chunk by chunk, transformers' `Qwen3OmniMoeCode2Wav`
on the same window of frames, cut as vllm-omni's streaming decode cuts it (the left context's
samples, less the few the causal decoder held back at the previous chunk's end), so the chunks
join into one stream with nothing twice.
Three engines and three sidecars start: about 90 s on 2 busy cores (in `make test` of such a venv,
as the pipeline test).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.support.paired_vllm_omni import build_tiny_qwen3_omni, paired_pythonpath, skip_unless_paired
from tests.support.procs import child_env
from tests.support.serve import serving

pytestmark = pytest.mark.e2e
ENGINE = ('max_model_len = 256, max_num_seqs = 4, max_num_batched_tokens = 256, dtype = "bfloat16", seed = 0, '
          'enforce_eager = true, kv_cache_memory_bytes = 67108864, limit_mm_per_prompt = { image = 0, video = 0, audio = 0 }')


CHUNK, LEFT = 4, 4  # the server's code2wav chunks: frames each, frames of left context


def _config(work: Path, model: Path) -> Path:
    """deploy/speech/qwen3-omni-gpu.toml's stages, sized for CPU (eager, no device). code2wav a chunk a step:
    vllm-omni's decoder runs a step's windows as one zero-padded batch, where a shorter window's last
    samples see the padding (its own behaviour, not what is checked here)."""
    path = work / "serve.toml"
    path.write_text(f'''
served_model_name = "qwen3-omni-tiny"
voices = ["chelsie", "ethan", "aiden"]
max_input_chars = 64
thinker_prompt = "tests.tiny_models.qwen3_omni:thinker_prompt"
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
engine = {{ {ENGINE.replace("max_num_seqs = 4", "max_num_seqs = 1")}, hf_overrides = {{ architectures = ["Qwen3OmniMoeCode2WavStage"] }} }}
sidecar = {{ hooks = "omni-code2wav", options = {{ chunk_frames = "{CHUNK}", left_context = "{LEFT}", codebook_size = "2048" }} }}
''')
    return path


def _env() -> dict[str, str]:
    return {"PYTHONPATH": paired_pythonpath(), "VLLM_USE_V2_MODEL_RUNNER": "1", "VLLM_PLUGINS": "omni_sidecar_shim"}


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    skip_unless_paired()
    return build_tiny_qwen3_omni(tmp_path_factory.mktemp("qwen3-omni-model") / "model")


@pytest.fixture(scope="module")
def server(model, tmp_path_factory):
    work = tmp_path_factory.mktemp("serve-qwen3-omni")
    with serving(work, _config(work, model), _env()) as srv:
        yield srv


def test_a_text_request_is_spoken_through_the_three_stages_and_chat_speaks_too(server, model):
    """Thinker, vllm-omni's hand-over, the talker's decode steps (vllm-omni's code predictor on the shim's CPU
    platform for it) and code2wav: each answer is its codes' audio, the speech endpoint's and the chat
    endpoint's audio choice. (vllm-omni 0.26's code predictor samples its residual codes at random, whatever
    the request asks: two answers to one prompt differ; the parity drivers load it greedy.)"""
    import base64

    from omni_serve.speech.codes_log import read_codes_log

    status, pcm, _ = server.post({"input": "Hi there", "voice": "ethan", "response_format": "pcm"})
    assert status == 200, pcm[:2000]
    _spoken_from_logged_codes(pcm, read_codes_log(server.codes_log)[-1][1], model)
    status, body, _ = server.post({"messages": [{"role": "user", "content": "Hi there"}], "voice": "ethan",
                                   "modalities": ["text", "audio"], "audio": {"format": "pcm"}},
                                  "/v1/chat/completions")
    assert status == 200, body[:2000]
    text, spoken = json.loads(body)["choices"]
    assert text["message"]["content"]
    _spoken_from_logged_codes(base64.b64decode(spoken["message"]["audio"]["data"]),
                              read_codes_log(server.codes_log)[-1][1], model)


def _spoken_from_logged_codes(pcm: bytes, codes, model: Path) -> None:
    """PCM that is transformers' decoder on each of the server's windows of `codes`, joined."""
    from proto.chunk_grid import ChunkGrid

    assert codes.shape[1] == 16 and 0 < codes.shape[0] <= 8 and (codes < 2048).all(), codes
    want = torch.cat(_decoded_chunks(model, torch.tensor(codes), ChunkGrid(CHUNK, 0), LEFT))
    got = torch.frombuffer(bytearray(pcm), dtype=torch.int16).float() / 32767
    assert got.numel() == want.numel() and float(want.std()) > 1e-2, (got.numel(), want.numel())
    # Both bf16 on the same weights and frames (and 16-bit PCM here); the engine may order reductions otherwise.
    assert float((got - want.clamp(-1, 1)).abs().max()) <= 0.05 * float(want.abs().max())


def _decoded_chunks(model: Path, codes: torch.Tensor, grid, left: int) -> list[torch.Tensor]:
    """Transformers' `Qwen3OmniMoeCode2Wav` on each chunk's window of `codes` [frames, Q], cut as vllm-omni's
    streaming decode cuts it: the chunk's frames' samples, plus those the previous chunk held back (its causal
    decoder holds a few back at a window's end), less its own held back: the chunks join with nothing twice."""
    from safetensors.torch import load_file
    from transformers import AutoConfig
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeCode2Wav

    config = AutoConfig.from_pretrained(model).code2wav_config
    reference = Qwen3OmniMoeCode2Wav._from_config(config, dtype=torch.bfloat16).eval()
    reference.load_state_dict({k[len("code2wav."):]: v for k, v in load_file(str(model / "model.safetensors")).items()
                               if k.startswith("code2wav.")}, strict=True)
    spf, frames, held_back, out = int(reference.total_upsample), codes.shape[0], 0, []
    for k in range(grid.count(frames)):
        lo, start, end = grid.span(k, frames, left)
        with torch.no_grad():
            window = reference(codes[lo:end].t().unsqueeze(0)).reshape(-1).float()
        tail = (end - lo) * spf - window.numel()
        out.append(window[max(0, (start - lo) * spf - tail):])
        assert out[-1].numel() == (end - start) * spf + held_back - tail, k
        held_back = tail
    return out


def test_the_servers_code2wav_chunks_are_transformers_decoder_on_each_window(model, tmp_path):
    from proto.chunk_grid import ChunkGrid
    from tests.tiny_models.qwen3_omni import NUM_CODE_GROUPS

    frames, chunk, left, first = 11, 4, 3, 1
    codes = torch.randint(0, 2048, (frames, NUM_CODE_GROUPS), generator=torch.Generator().manual_seed(4))
    # One chunk a step: vllm-omni's decoder runs a step's windows as one zero-padded batch, where a shorter
    # window's last samples see the padding (its own behaviour, not what is checked here).
    engine = {"max_model_len": 64, "max_num_seqs": 1, "max_num_batched_tokens": 64, "dtype": "bfloat16", "seed": 0,
              "enforce_eager": True, "kv_cache_memory_bytes": 16 << 20,
              "limit_mm_per_prompt": {"image": 0, "video": 0, "audio": 0},
              "hf_overrides": {"architectures": ["Qwen3OmniMoeCode2WavStage"]}}
    job = {"model": str(model), "engine": engine, "codes": codes.tolist(), "chunk_frames": chunk, "left_context": left,
           "initial_chunk_frames": first}
    (tmp_path / "job.json").write_text(json.dumps(job))
    done = subprocess.run([sys.executable, "-m", "tests.support.qwen3_omni_code2wav_job", str(tmp_path / "job.json"),
                           str(tmp_path / "result.json")], env=child_env(**_env()), timeout=600, capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stderr[-3000:]  # a child that died says why
    result = json.loads((tmp_path / "result.json").read_text())
    assert "error" not in result, result.get("traceback")
    grid = ChunkGrid(chunk, first)
    assert len(result["chunks"]) == grid.count(frames) == 4  # 1 + 4 + 4 + 2 frames

    for k, (got, want) in enumerate(zip(result["chunks"], _decoded_chunks(model, codes, grid, left), strict=True)):
        got = torch.tensor(got)
        assert got.numel() == want.numel(), (k, got.numel(), want.numel())
        assert float(want.std()) > 1e-2, "a silent chunk proves nothing"
        # Both bf16 on the same weights and frames; the engine's decoder may order reductions otherwise.
        assert float((got - want).abs().max()) <= 0.05 * float(want.abs().max()), k


def test_a_text_only_chat_runs_vllm_omnis_thinker_alone_whole_or_streamed(server):
    from tests.tiny_models.qwen3_omni import thinker_prompt

    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "Hi there"}]
    request = {"messages": messages, "voice": "ethan", "modalities": ["text"]}
    status, body, _ = server.post(request, "/v1/chat/completions")
    assert status == 200, body[:2000]
    answer = json.loads(body)
    (choice,) = answer["choices"]
    assert choice["message"]["role"] == "assistant" and choice["finish_reason"] == "length"
    prompt = len(thinker_prompt(messages, 1)[0])
    assert answer["usage"] == {"prompt_tokens": prompt, "completion_tokens": 4, "total_tokens": prompt + 4}
    # Greedy: the streamed deltas add up to the same text.
    status, sse, _ = server.post({**request, "stream": True}, "/v1/chat/completions")
    events = [json.loads(line[6:]) for line in sse.decode().splitlines()
              if line.startswith("data: ") and line != "data: [DONE]"]
    assert status == 200 and all(e["modality"] == "text" for e in events)
    assert "".join(e["choices"][0]["delta"]["content"] for e in events) == choice["message"]["content"]
