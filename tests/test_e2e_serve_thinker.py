"""`omni-serve` with examples/demo.py's three stages: thinker (tiny Qwen2-VL, text only) -> talker ->
code2wav, each a real vLLM V2 engine with the shim and a sidecar process the server starts
(deploy/speech/tiny-thinker.toml's shape, smaller).

A WAV from `POST /v1/audio/speech` equals the three stages run by hand on the same input
(tests/support/speech_reference.py: the thinker's greedy tokens and hidden rows from a direct
transformers forward, the talker's request made from them, the talker's and the codec's direct
forwards); an SSE stream carries the same samples and the thinker's prompt as its input tokens.
`POST /v1/chat/completions` answers with the thinker's greedy tokens detokenized and the speech
endpoint's audio of the same prompt, whole or streamed, or the text alone; bad input gets a 400;
a chat client gone aborts its request in all three stages.
Slow (`make test-slow`): three engines start; about 70 s on 2 idle cores, 3 to 4 minutes on busy ones.
"""

from __future__ import annotations

import base64
import json
import socket
import time
import wave
from io import BytesIO
from pathlib import Path

import numpy as np
import pytest

from tests.support.serve import TINY_ENGINE, metric, serving, wait_all_finished
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
thinker_prompt = "tests.tiny_models.vl:thinker_prompt"
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


def _events(body: bytes) -> list[dict]:
    lines = [line[6:] for line in body.decode().splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_a_chat_answer_is_the_thinkers_text_and_the_speech_of_the_same_prompt(server, models):
    from transformers import AutoTokenizer

    from tests.support.speech_reference import thinker_rows
    from tests.tiny_models.vl import thinker_prompt

    messages = [{"role": "user", "content": TEXT}]
    _, tokens = thinker_rows(models[0], thinker_prompt(messages, 1)[0], THINKER_TOKENS)
    text = AutoTokenizer.from_pretrained(models[0]).decode(tokens, skip_special_tokens=True)
    assert len(tokens) == THINKER_TOKENS and text  # the tiny thinker's greedy tokens read as some text
    status, speech, _ = server.post({"input": TEXT, "voice": "vivian", "response_format": "wav"})
    assert status == 200

    # vllm-omni's whole answer: a text choice, then an audio choice (base64 WAV in message.audio.data).
    status, body, kind = server.post({"model": "tiny-omni", "messages": messages, "modalities": ["text", "audio"],
                                      "audio": {"voice": "vivian", "format": "wav"}}, "/v1/chat/completions")
    assert status == 200 and kind == "application/json", body[:500]
    answer = json.loads(body)
    assert answer["object"] == "chat.completion" and [c["index"] for c in answer["choices"]] == [0, 0]
    said, spoken = (c["message"] for c in answer["choices"])
    assert said == {"role": "assistant", "content": text} and answer["choices"][0]["finish_reason"] == "length"
    assert spoken["content"] is None and base64.b64decode(spoken["audio"]["data"]) == speech
    prompt = 1 + len(TEXT.encode())
    assert answer["usage"] == {"prompt_tokens": prompt, "completion_tokens": THINKER_TOKENS,
                               "total_tokens": prompt + THINKER_TOKENS}

    # Streamed (vllm-omni's top-level voice, pcm16): the text's deltas, then the audio chunk by chunk.
    status, sse, kind = server.post({"messages": messages, "voice": "vivian", "audio": {"format": "pcm16"},
                                     "stream": True, "stream_options": {"include_usage": True}},
                                    "/v1/chat/completions")
    assert status == 200 and kind.startswith("text/event-stream"), sse[:500]
    events = _events(sse)
    said = [e for e in events if e.get("modality") == "text"]
    spoken = [e for e in events if e.get("modality") == "audio"]
    assert events == said + spoken + events[-1:] and len(spoken) == MAX_FRAMES // CHUNK
    assert said[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(e["choices"][0]["delta"]["content"] for e in said) == text
    assert b"".join(base64.b64decode(e["choices"][0]["delta"]["content"]) for e in spoken) == speech[44:]
    assert [e["choices"][0]["finish_reason"] for e in said + spoken] == [None] * (len(said) + len(spoken) - 1) + ["stop"]
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == THINKER_TOKENS

    # Text only: the thinker alone.
    status, body, _ = server.post({"messages": messages, "voice": "vivian", "modalities": ["text"]},
                                  "/v1/chat/completions")
    assert status == 200 and [c["message"] for c in json.loads(body)["choices"]] == [
        {"role": "assistant", "content": text}]

    # As vllm-omni's example clients ask: each stage's sampling in `sampling_params_list` (their model's
    # lengths, capped at this server's: the thinker's 2 tokens, the talker's CHUNK frames, a token more
    # as in the config's max_tokens), OpenAI's
    # audio.voice (none of ours: the default voice) and a soundfile format.
    import soundfile

    status, body, _ = server.post({"messages": messages, "audio": {"voice": "alloy", "format": "flac"},
                                   "sampling_params_list": [{"temperature": 0.0, "max_tokens": 2, "seed": 42},
                                                            {"temperature": 0.0, "max_tokens": CHUNK + 1},
                                                            {"temperature": 0.0, "max_tokens": 65536}]},
                                  "/v1/chat/completions")
    assert status == 200, body[:500]
    answer = json.loads(body)
    assert answer["usage"]["completion_tokens"] == 2
    samples, rate = soundfile.read(BytesIO(base64.b64decode(answer["choices"][1]["message"]["audio"]["data"])))
    assert rate == 300 and samples.shape == (CHUNK * 24,)

    # Bad input: one line, and the server serves on.
    for bad, needle in [({"messages": []}, "messages is empty"),
                        ({"messages": messages, "modalities": ["image"]}, "unsupported output modalities image"),
                        ({"messages": messages, "voice": "alloy"}, "unknown voice 'alloy'"),
                        ({"messages": messages, "audio": {"format": "mp3"}}, "audio format 'mp3'"),
                        # 3 UTF-8 bytes a character, a token each: past the thinker's max_model_len.
                        ({"messages": [{"role": "user", "content": "\u8bed" * 64}]}, "a prompt of 193 tokens"),
                        # Past the thinker's vocabulary: its engine would fail the request (a 503).
                        ({"messages": messages, "stop_token_ids": [2**40]}, "outside its vocabulary")]:
        status, body, _ = server.post(bad, "/v1/chat/completions")
        assert status == 400 and needle in json.loads(body)["error"]["message"], body
    status, body, _ = server.post(b"{", "/v1/chat/completions")
    assert status == 400 and "not valid JSON" in json.loads(body)["error"]["message"]
    assert server.get("/health")[0] == 200


def test_a_chat_client_that_disconnects_aborts_its_request_in_every_stage(server):
    from omni_sidecar.client import SidecarClient

    stages = ("thinker", "talker", "code2wav")
    wait_all_finished(server, stages)
    conn = server.connection()
    conn.request("POST", "/v1/chat/completions", body=json.dumps(
        {"messages": [{"role": "user", "content": TEXT}], "stream": True}), headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    rid = resp.getheader("X-Request-Id")
    assert resp.status == 200 and rid.startswith("chatcmpl-") and resp.read1(1 << 16).startswith(b"data: ")
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    wait_all_finished(server, stages)
    deadline = time.monotonic() + 10
    for stage in stages:  # nothing kept once the front end saw it finish there
        with SidecarClient(server.endpoint(stage)) as client:
            while client.outputs(rid) is not None or client.outputs(f"{rid}-c0") is not None:
                assert time.monotonic() < deadline, f"the {stage} sidecar still keeps {rid}'s outputs"
                time.sleep(0.05)
    while any(metric(server, f'omni_serve_stage_requests{{stage="{stage}"}}') != 0 for stage in stages):
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert metric(server, 'omni_serve_requests_total{outcome="aborted"}') == 1  # the module's only one
