"""`omni-serve` with examples/demo.py's three stages: thinker (tiny Qwen2-VL, text only) -> talker ->
code2wav, each a real vLLM V2 engine with the shim and a sidecar process the server starts
(deploy/speech/tiny-thinker.toml's shape, smaller).

A WAV from `POST /v1/audio/speech` equals the three stages run by hand on the same input
(tests/support/speech_reference.py: the thinker's greedy tokens and hidden rows from a direct
transformers forward, the talker's request made from them, the talker's and the codec's direct
forwards); an SSE stream carries the same samples and the thinker's prompt as its input tokens.
Slow (`make test-slow`): three engines start; about 70 s on 2 idle cores, 3 to 4 minutes on busy ones.
"""

from __future__ import annotations

import base64
import json
import wave
from io import BytesIO
from pathlib import Path

import numpy as np
import pytest

from tests.support.serve import TINY_ENGINE, serving
from tests.support.speech_reference import pcm16, thinker_reference_samples

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
CHUNK, LEFT = 4, 8
THINKER_TOKENS = 4
MAX_FRAMES = 8
TEXT = "three stages"


def _config(work: Path, thinker: str, talker: str, code2wav: str) -> Path:
    engine = TINY_ENGINE
    path = work / "serve.toml"
    path.write_text(f'''
served_model_name = "tiny-omni"
voices = ["default", "vivian"]
max_input_chars = 64
speech_prompt = "tests.tiny_models.vl:speech_prompt"
talker_prompt = "tests.tiny_models.talker:thinker_talker_prompt"
register = ["tests.support.vl_model:register", "tests.tiny_models.talker:register",
            "tests.tiny_models.code2wav:register"]
sample_rate = 300

[stages.thinker]
model = "{thinker}"
max_tokens = {THINKER_TOKENS}
engine = {{ {engine}, skip_tokenizer_init = false }}
sampling = {{ temperature = 0.0, ignore_eos = true }}
sidecar = {{ hooks = "omni-thinker" }}

[stages.talker]
model = "{talker}"
max_tokens = {MAX_FRAMES + 1}
engine = {{ {engine} }}
sampling = {{ temperature = 0.0, ignore_eos = true }}
sidecar = {{ hooks = "omni-talker" }}

[stages.code2wav]
model = "{code2wav}"
placeholder_token = 1
engine = {{ {engine} }}
sidecar = {{ hooks = "omni-code2wav", options = {{ chunk_frames = "{CHUNK}", left_context = "{LEFT}", codebook_size = "64" }} }}
''')
    return path


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from tests.tiny_models.code2wav import build_tiny_code2wav
    from tests.tiny_models.talker import build_tiny_talker
    from tests.tiny_models.vl import build_tiny_vl_thinker

    root = tmp_path_factory.mktemp("serve-thinker-models")
    return (str(build_tiny_vl_thinker(root / "thinker")), str(build_tiny_talker(root / "talker")),
            str(build_tiny_code2wav(root / "code2wav")))


@pytest.fixture(scope="module")
def server(models, tmp_path_factory):
    work = tmp_path_factory.mktemp("serve-thinker")
    with serving(work, _config(work, *models)) as srv:
        yield srv


def test_a_wav_equals_the_three_stages_run_by_hand(server, models):
    want = pcm16(thinker_reference_samples(*models, TEXT, 1, THINKER_TOKENS, MAX_FRAMES + 1, CHUNK, LEFT))
    assert want.shape == (MAX_FRAMES * 24,) and np.abs(want).max() > 1000  # a real signal, not silence
    status, body, kind = server.post({"input": TEXT, "voice": "vivian", "response_format": "wav"})
    assert status == 200 and kind == "audio/wav", body[:500]
    with wave.open(BytesIO(body)) as wav:
        assert (wav.getframerate(), wav.getnchannels(), wav.getsampwidth()) == (300, 1, 2)
        got = np.frombuffer(wav.readframes(wav.getnframes()), dtype="<i2")
    assert got.shape == want.shape
    assert np.abs(got.astype(np.int32) - want).max() <= 1  # float32 sums in another order: one LSB at most
    # The voice is the thinker's first prompt token: another voice, other audio.
    status, other, _ = server.post({"input": TEXT, "voice": "default", "response_format": "pcm"})
    assert status == 200 and other != body[44:]
    # vllm-omni's SSE stream: the same samples; usage counts the thinker's prompt and the codec frames.
    status, sse, _ = server.post({"input": TEXT, "voice": "vivian", "response_format": "pcm", "stream": True})
    events = [json.loads(line[6:]) for line in sse.decode().splitlines() if line.startswith("data: ")]
    assert status == 200 and events[-1]["type"] == "speech.audio.done"
    assert b"".join(base64.b64decode(e["audio"]) for e in events[:-1]) == body[44:]
    prompt = 1 + len(TEXT.encode())
    assert events[-1]["usage"]["input_tokens"] == prompt and events[-1]["usage"]["output_tokens"] == MAX_FRAMES
    _, health = server.get("/health")
    assert sorted(json.loads(health)["stages"]) == ["code2wav", "talker", "thinker"]
