"""`omni-serve` for real: one server (talker -> code2wav on the tiny models, two real vLLM V2 engines
with the shim, two real sidecar processes it starts), real HTTP clients against it.

Checked, on the one server of this module:
- a WAV from `POST /v1/audio/speech` equals the stages run by hand on the same input
  (tests/support/speech_reference.py: the talker's and the codec's direct forwards, outside vLLM);
- pcm, a raw audio stream and vllm-omni's SSE stream carry the same samples; a stream's first chunk
  arrives before the request has finished;
- bad input (empty, over-long, unknown voice, unsupported format, bad JSON, unknown model, a field
  this model cannot honour) gets a 4xx with one message, and the server serves the next request;
- a client that disconnects mid-stream: its request ends in both engines and both sidecars, and
  nothing of it is kept;
- (`make test-slow`) a hot upgrade of either stage's sidecar while requests keep coming: every
  answer a 200 with the same audio, the successor adopted by the server;
- a stage's sidecar killed with requests in flight (the talker's; the code2wav's in
  `make test-slow`): those end with a 503 naming the stage as soon as the server finds it dead
  (well before the front end would give up waiting on it), any that were served carry the same
  audio, the server starts it again, and the first request once /health says so is served (the
  same audio);
- a stage's engine core killed with requests in flight: those and the next end with a 503 naming the
  stage, /health reports its engine down, the server starts it again and serves the same audio;
- /v1/models, /health and /metrics (time to first audio, real-time factor, per-stage requests).
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import wave
from io import BytesIO
from pathlib import Path

import numpy as np
import pytest
from websockets.exceptions import ConnectionClosed, ConnectionClosedOK

from proto.chunk_grid import ChunkGrid
from tests.support.procs import child_env
from tests.support.serve import TINY_ENGINE, Server, live_requests, metric, serving, wait_all_finished
from tests.support.speech_reference import pcm16, reference_samples

pytestmark = pytest.mark.e2e
CHUNK, LEFT = 4, 8
INITIAL = 1  # the first chunk a frame long, then chunks of CHUNK: the audio is the same
MAX_FRAMES = 16  # the last chunk's window starts past frame 0: the payload is cut to the left context
UPGRADE_TIMEOUT_S = 240
TEXT = "a sidecar speaks"
STAGES = ("talker", "code2wav")


def _config(work: Path, talker: str, code2wav: str, max_frames: int = MAX_FRAMES + 1,
            talker_engine: str = TINY_ENGINE) -> Path:
    engine = f"{{ {TINY_ENGINE} }}"
    path = work / "serve.toml"
    path.write_text(f'''
served_model_name = "tiny-tts"
voices = ["default", "vivian"]
max_input_chars = 64
speech_prompt = "tests.tiny_models.talker:speech_prompt"
register = ["tests.tiny_models.talker:register", "tests.tiny_models.code2wav:register"]
sample_rate = 300

[stages.talker]
model = "{talker}"
max_tokens = {max_frames}
engine = {{ {talker_engine} }}
sampling = {{ temperature = 0.0, ignore_eos = true }}
sidecar = {{ hooks = "omni-talker" }}

[stages.code2wav]
model = "{code2wav}"
placeholder_token = 1
engine = {engine}
sidecar = {{ hooks = "omni-code2wav", options = {{ chunk_frames = "{CHUNK}", left_context = "{LEFT}", initial_chunk_frames = "{INITIAL}", codebook_size = "64" }} }}
''')
    return path


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from tests.tiny_models.code2wav import build_tiny_code2wav
    from tests.tiny_models.talker import build_tiny_talker

    root = tmp_path_factory.mktemp("serve-models")
    return str(build_tiny_talker(root / "talker")), str(build_tiny_code2wav(root / "code2wav"))


@pytest.fixture(scope="module")
def server(models, tmp_path_factory):
    work = tmp_path_factory.mktemp("serve")
    with serving(work, _config(work, *models)) as srv:
        yield srv


@pytest.fixture(scope="module")
def reference(models):
    samples = reference_samples(*models, TEXT, 1, MAX_FRAMES + 1, CHUNK, LEFT)
    assert samples.shape == (MAX_FRAMES * 24,)  # one frame per decode step
    return samples


def test_a_wav_equals_the_stages_run_by_hand(server, reference):
    status, body, kind = server.post({"model": "tiny-tts", "input": TEXT, "voice": "vivian", "response_format": "wav"})
    assert status == 200, body[:500]
    assert kind == "audio/wav"
    with wave.open(BytesIO(body)) as wav:
        assert (wav.getframerate(), wav.getnchannels(), wav.getsampwidth()) == (300, 1, 2)
        got = np.frombuffer(wav.readframes(wav.getnframes()), dtype="<i2")
    want = pcm16(reference)
    assert got.shape == want.shape == (MAX_FRAMES * 24,)
    assert np.abs(got.astype(np.int32) - want).max() <= 1  # float32 sums in another order: one LSB at most
    assert np.abs(want).max() > 1000  # a real signal, not silence
    # Another voice is another request: other audio.
    status, other, _ = server.post({"input": TEXT, "voice": "default", "response_format": "pcm"})
    assert status == 200 and other != body[44:]
    # FLAC, as vllm-omni writes it (soundfile): the same 16-bit samples; the voice named as its client does.
    import soundfile

    status, flac, kind = server.post({"input": TEXT, "voice": "Vivian", "response_format": "flac",
                                      "task_type": "CustomVoice", "language": "Auto"})
    assert status == 200 and kind == "audio/flac", flac[:500]
    decoded, rate = soundfile.read(BytesIO(flac), dtype="int16")
    assert rate == 300 and np.abs(decoded.astype(np.int32) - got).max() <= 1


def test_a_batch_speaks_each_item_as_its_own_request(server, reference):
    """vllm-omni's /v1/audio/speech/batch: the items at once, the batch's fields under each item's own; an
    item's fault is its own result's error, the others are answered."""
    status, body, kind = server.post({"voice": "vivian", "response_format": "pcm", "items": [
        {"input": TEXT}, {"input": TEXT, "voice": "nobody"}, {"input": TEXT, "response_format": "wav"},
        {"input": TEXT, "voice": "default"}]}, path="/v1/audio/speech/batch")
    assert status == 200 and kind == "application/json", body[:500]
    answer = json.loads(body)
    assert (answer["total"], answer["succeeded"], answer["failed"]) == (4, 3, 1) and answer["id"].startswith("speech-batch-")
    first, unknown, as_wav, other = answer["results"]
    assert [r["index"] for r in answer["results"]] == [0, 1, 2, 3]
    got = np.frombuffer(base64.b64decode(first["audio_data"]), dtype="<i2")
    assert first["media_type"] == "audio/pcm" and np.abs(got.astype(np.int32) - pcm16(reference)).max() <= 1
    assert first["usage"]["output_tokens"] == MAX_FRAMES
    assert unknown == {"index": 1, "status": "error", "error": "unknown voice 'nobody'; voices: default, vivian"}
    with wave.open(BytesIO(base64.b64decode(as_wav["audio_data"]))) as wav:
        assert np.array_equal(np.frombuffer(wav.readframes(wav.getnframes()), dtype="<i2"), got)
    assert base64.b64decode(other["audio_data"]) != got.tobytes()  # another voice, other audio
    # What vllm-omni's batch schema refuses is refused for the whole batch; a field it has not, by name when set.
    status, body, _ = server.post({"stream": False, "seed": None, "items": [{"input": TEXT, "model": None}]},
                                  path="/v1/audio/speech/batch")
    assert status == 200 and json.loads(body)["succeeded"] == 1, body
    for batch, want, param, needle in (
            ({"items": []}, 400, "items", "at least 1 item"),
            ({"items": [{"input": TEXT}] * 33}, 400, "items", "at most 32"),
            ({"response_format": "ogg", "items": [{"input": TEXT}]}, 400, "response_format", "'wav', 'pcm'"),
            ({"items": [{"input": TEXT, "seed": 1}]}, 400, "items.0.seed", "not a batch speech field: items.0.seed"),
            ({"model": "other", "items": [{"input": TEXT}]}, 404, "model", "not served here")):
        status, body, _ = server.post(batch, path="/v1/audio/speech/batch")
        error = json.loads(body)["error"]
        assert status == want and error["param"] == param and needle in error["message"], (batch, body)


def test_the_codes_log_has_each_served_requests_codes_as_the_talker_makes_them(server, models):
    """`--codes-log`: a line per request served whole, its codes the talker's own (its direct
    forward), appended as the request ends."""
    from omni_serve.speech.codes_log import read_codes_log
    from tests.support.speech_reference import speech_codes

    before = len(read_codes_log(server.codes_log))
    status, body, _ = server.post({"input": TEXT, "voice": "vivian", "response_format": "pcm"})
    assert status == 200, body[:500]
    logged = read_codes_log(server.codes_log)
    assert len(logged) == before + 1
    want = speech_codes(models[0], TEXT, 1, MAX_FRAMES + 1).numpy()
    assert want.shape[0] == MAX_FRAMES
    np.testing.assert_array_equal(logged[-1][1], want)


def test_streams_carry_the_same_samples_and_the_first_chunk_comes_before_the_end(server, reference):
    status, pcm, kind = server.post({"input": TEXT, "voice": "vivian", "response_format": "pcm"})
    assert status == 200 and kind == "audio/pcm"
    conn = server.connection()
    conn.request("POST", "/v1/audio/speech", body=json.dumps(
        {"input": TEXT, "voice": "vivian", "response_format": "pcm", "stream": True, "stream_format": "audio"}),
        headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    t0 = time.monotonic()
    first = resp.read1(1 << 20)
    first_at = time.monotonic()
    rest = resp.read()
    done_at = time.monotonic()
    conn.close()
    assert 0 < len(first) < len(pcm)  # one chunk, not the whole audio
    assert first + rest == pcm
    assert first_at - t0 < done_at - t0
    # vllm-omni's default stream: SSE speech.audio.delta events, then speech.audio.done.
    status, sse, kind = server.post({"input": TEXT, "voice": "vivian", "response_format": "pcm", "stream": True})
    assert status == 200 and kind.startswith("text/event-stream")
    events = [json.loads(line[6:]) for line in sse.decode().splitlines() if line.startswith("data: ")]
    assert [e["type"] for e in events][-1] == "speech.audio.done"
    deltas = [e for e in events if e["type"] == "speech.audio.delta"]
    assert len(deltas) == ChunkGrid(CHUNK, INITIAL).count(MAX_FRAMES)  # one per chunk
    assert len(base64.b64decode(deltas[0]["audio"])) == INITIAL * 24 * 2  # the short first chunk: 24 samples a frame
    assert b"".join(base64.b64decode(e["audio"]) for e in deltas) == pcm
    assert {e["response_format"] for e in deltas} == {"pcm"}
    # SSE of a WAV, as vllm-omni sends it: the header the first delta, the deltas joined a WAV file.
    status, sse, _ = server.post({"input": TEXT, "voice": "vivian", "stream": True})
    events = [json.loads(line[6:]) for line in sse.decode().splitlines() if line.startswith("data: ")]
    deltas = [base64.b64decode(e["audio"]) for e in events if e["type"] == "speech.audio.delta"]
    assert status == 200 and len(deltas[0]) == 44 and deltas[0].startswith(b"RIFF")
    with wave.open(BytesIO(b"".join(deltas))) as wav:
        assert wav.getframerate() == 300 and wav.readframes(1 << 20) == pcm
    # The OpenAI SDK's stream: a stream_format and no `stream`.
    status, streamed, kind = server.post({"input": TEXT, "voice": "vivian", "response_format": "pcm",
                                          "stream_format": "audio"})
    assert (status, kind, streamed) == (200, "audio/pcm", pcm)
    # vllm-omni's usage: the text's tokens as the talker reads them (the tiny talker's rows: the
    # voice's, then one per byte), the codec frames it made.
    text_tokens = 1 + len(TEXT.encode())
    assert events[-1]["usage"] == {"input_tokens": text_tokens, "output_tokens": MAX_FRAMES,
                                   "total_tokens": text_tokens + MAX_FRAMES,
                                   "input_token_details": {"text_tokens": text_tokens, "audio_tokens": 0}}


@pytest.mark.parametrize("body, status, needle", [
    ({"input": ""}, 400, "input is empty"),
    ({"input": "   "}, 400, "input is empty"),
    ({"input": "x" * 65}, 400, "at most 64"),
    ({"input": "hi", "voice": "nobody"}, 400, "unknown voice 'nobody'"),
    ({"input": "hi", "response_format": "aac"}, 400, "response_format 'aac' is not supported"),
    ({"input": "hi", "response_format": "opus"}, 400, "this model's 300 Hz audio"),
    ({"input": "hi", "model": "gpt-4o-mini-tts"}, 404, "not served here"),
    ({"input": "hi", "speed": 2.0}, 400, "not supported by this model: speed"),
    ({"input": "hi", "speed": 9.0}, 400, "speed"),
    ({"input": "hi", "ref_audio": "data:audio/wav;base64,AAAA"}, 400, "ref_audio"),
    ({"input": "hi", "max_new_tokens": 10_000}, 400, "max_new_tokens"),
    ({"voice": "vivian"}, 400, "input"),
    (b"{not json", 400, "not valid JSON"),
    (b"[1, 2]", 400, "JSON object"),
])
def test_bad_input_gets_a_4xx_with_one_message(server, body, status, needle):
    got, answer, kind = server.post(body)
    assert got == status, answer
    assert kind == "application/json"
    error = json.loads(answer)["error"]
    assert needle in error["message"] and error["code"] == status


def _ws(server):
    from websockets.sync.client import connect

    return connect(f"ws://127.0.0.1:{server.port}/v1/audio/speech/stream", open_timeout=30)


def _utterance(ws) -> tuple[dict, bytes, dict, dict]:
    """audio.start, the audio's binary frames joined, audio.done, session.done."""
    start = json.loads(ws.recv(timeout=120))
    frames = []
    while isinstance(message := ws.recv(timeout=120), bytes):
        frames.append(message)
    return start, b"".join(frames), json.loads(message), json.loads(ws.recv(timeout=120))


def test_the_websocket_stream_speaks_each_flush_as_vllm_omnis_does(server):
    status, pcm, _ = server.post({"input": TEXT, "voice": "vivian", "response_format": "pcm"})
    status_wav, wav_body, _ = server.post({"input": TEXT, "voice": "vivian"})
    assert status == status_wav == 200
    with _ws(server) as ws:
        ws.send(json.dumps({"type": "session.config", "voice": "Vivian", "response_format": "pcm",
                            "stream_audio": True}))
        half = len(TEXT) // 2
        for part in (TEXT[:half], TEXT[half:]):  # text as it is written: one request at the flush
            ws.send(json.dumps({"type": "input.text", "text": part}))
        ws.send(json.dumps({"type": "input.done"}))
        start, audio_bytes, done, flushed = _utterance(ws)
        assert start == {"type": "audio.start", "utterance_index": 0, "sentence_index": 0, "sentence_text": TEXT,
                         "format": "pcm", "sample_rate": 300}
        assert audio_bytes == pcm  # chunk by chunk, the same samples as POST /v1/audio/speech
        assert done == {"type": "audio.done", "utterance_index": 0, "sentence_index": 0, "total_bytes": len(pcm),
                        "error": False}
        assert flushed == {"type": "session.done", "utterance_index": 0, "total_sentences": 1}
        # The connection stays: a new config between utterances, a whole WAV this time.
        ws.send(json.dumps({"type": "session.config", "voice": "vivian"}))
        ws.send(json.dumps({"type": "input.text", "text": TEXT}))
        ws.send(json.dumps({"type": "input.done"}))
        start, whole, done, flushed = _utterance(ws)
        assert (start["format"], start["utterance_index"], whole, done["total_bytes"]) == ("wav", 1, wav_body, len(wav_body))
        # Refused messages after a good config: said, and the session serves on.
        for bad, needle in [("{", "not valid JSON"), (json.dumps({"type": "nope"}), "unknown message type 'nope'"),
                            (json.dumps({"type": "session.config", "response_format": "wav", "stream_audio": True}),
                             "set response_format='pcm'"),
                            (json.dumps({"type": "session.config", "voice": "nobody"}), "unknown voice 'nobody'"),
                            (json.dumps({"type": "session.config", "stream_format": "sse"}), "takes no stream_format")]:
            ws.send(bad)
            error = json.loads(ws.recv(timeout=30))
            assert error["type"] == "error" and needle in error["message"], error
        ws.send(b"\x00binary")  # the protocol's messages are JSON text
        error = json.loads(ws.recv(timeout=30))
        assert error["type"] == "error" and "a binary frame" in error["message"]
        ws.send(json.dumps({"type": "input.done"}))  # nothing buffered: no audio
        assert json.loads(ws.recv(timeout=30)) == {"type": "session.done", "utterance_index": 2, "total_sentences": 0}
        # Text past the config's max_input_chars (64): the message that crosses it refused, the rest spoken.
        ws.send(json.dumps({"type": "input.text", "text": "x" * 60}))
        ws.send(json.dumps({"type": "input.text", "text": "y" * 10}))
        error = json.loads(ws.recv(timeout=30))
        assert error["type"] == "error" and "would pass 64 characters" in error["message"]
        ws.send(json.dumps({"type": "input.done"}))
        start, spoken, done, flushed = _utterance(ws)
        assert start["sentence_text"] == "x" * 60 and len(spoken) > 44 and done["error"] is False
        assert flushed["utterance_index"] == 3
        ws.send(json.dumps({"type": "session.close"}))
        with pytest.raises(ConnectionClosedOK):  # closed by the server, normally (not a timeout)
            ws.recv(timeout=30)
    # Before a good config a refusal ends the connection, as in vllm-omni.
    for first, needle in [(json.dumps({"type": "input.text", "text": "hi"}), "must be session.config"),
                          (json.dumps({"type": "session.config", "word_timestamps": "true"}), "forced aligner"),
                          (json.dumps({"type": "session.config", "stream_audio": "maybe"}), "true or false"),
                          (json.dumps({"type": "session.config", "speed": 2.0}), "speed")]:
        with _ws(server) as ws:
            ws.send(first)
            error = json.loads(ws.recv(timeout=30))
            assert error["type"] == "error" and needle in error["message"], error
            with pytest.raises(ConnectionClosed):  # closed by the server (a timeout is no ConnectionClosed)
                ws.recv(timeout=30)
    wait_all_finished(server, STAGES)


def test_a_websocket_client_gone_mid_utterance_aborts_its_request(server):
    def aborted() -> float:  # the label appears with the first abort
        try:
            return metric(server, 'omni_serve_requests_total{outcome="aborted"}')
        except AssertionError:
            return 0.0

    wait_all_finished(server, STAGES)
    aborted_before = aborted()
    with _ws(server) as ws:
        ws.send(json.dumps({"type": "session.config", "response_format": "pcm", "stream_audio": True}))
        ws.send(json.dumps({"type": "input.text", "text": TEXT}))
        ws.send(json.dumps({"type": "input.done"}))
        assert json.loads(ws.recv(timeout=120))["type"] == "audio.start"
        assert isinstance(ws.recv(timeout=120), bytes)  # its first chunk: the request runs in every stage
        ws.socket.shutdown(socket.SHUT_RDWR)  # gone, without a closing handshake
    wait_all_finished(server, STAGES)
    deadline = time.monotonic() + 10
    while aborted() < aborted_before + 1:
        assert time.monotonic() < deadline, "the request was not aborted"
        time.sleep(0.1)


def test_chat_without_a_thinker_stage_is_a_404_naming_the_speech_endpoint(server):
    status, body, _ = server.post({"messages": [{"role": "user", "content": "hi"}]}, "/v1/chat/completions")
    message = json.loads(body)["error"]["message"]
    assert status == 404 and "no thinker stage" in message and "/v1/audio/speech" in message


def test_the_server_serves_on_after_bad_input(server, reference):
    status, pcm, _ = server.post({"input": TEXT, "voice": "vivian", "response_format": "pcm"})
    assert status == 200
    assert np.abs(np.frombuffer(pcm, "<i2").astype(np.int32) - pcm16(reference)).max() <= 1


def test_a_client_that_disconnects_aborts_its_request_everywhere(server):
    from omni_sidecar.client import SidecarClient

    wait_all_finished(server, STAGES)
    talker_before = live_requests(server.endpoint("talker"))[0]
    conn = server.connection()
    conn.request("POST", "/v1/audio/speech", body=json.dumps(
        {"input": TEXT, "response_format": "pcm", "stream": True, "stream_format": "audio",
         "max_new_tokens": MAX_FRAMES + 1}), headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    rid = resp.getheader("X-Request-Id")
    assert resp.status == 200 and resp.read1(1 << 16)
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    wait_all_finished(server, STAGES)
    assert live_requests(server.endpoint("talker"))[0] == talker_before + 1
    deadline = time.monotonic() + 10
    for stage in ("talker", "code2wav"):  # nothing kept once the front end saw it finish there
        with SidecarClient(server.endpoint(stage)) as client:
            while client.outputs(rid) is not None or client.outputs(f"{rid}-c0") is not None:
                assert time.monotonic() < deadline, f"the {stage} sidecar still keeps {rid}'s outputs"
                time.sleep(0.05)
    while any(metric(server, f'omni_serve_stage_requests{{stage="{stage}"}}') != 0
              for stage in ("talker", "code2wav")):
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert metric(server, 'omni_serve_requests_total{outcome="aborted"}') >= 1


@pytest.mark.slow  # about 80 s for both stages on 2 cores: `make test-slow`
@pytest.mark.parametrize("stage, options", [
    ("talker", []),
    ("code2wav", [f"chunk_frames={CHUNK}", f"left_context={LEFT}", "codebook_size=64"]),
])
def test_a_hot_upgrade_of_a_stage_under_load_loses_nothing(server, reference, stage, options):
    from omni_sidecar.client import SidecarClient

    with SidecarClient(server.endpoint(stage)) as client:
        before = client.status().pid
    stop = threading.Event()
    answers: list[tuple[int, bytes, float, float]] = []

    def client_loop() -> None:
        while not stop.is_set():
            t0 = time.monotonic()
            status, body, _ = server.post({"input": TEXT, "voice": "vivian", "response_format": "pcm"})
            answers.append((status, body, t0, time.monotonic()))

    threads = [threading.Thread(target=client_loop) for _ in range(3)]
    for t in threads:
        t.start()
    try:
        while len(answers) < 3:  # the load is on
            time.sleep(0.05)
        # A cold start of the successor (Python, torch, the hooks) on a busy 2-core host: minutes at worst.
        cmd = [sys.executable, "-m", "omni_sidecar.cli", "upgrade", "--endpoint", server.endpoint(stage),
               "--timeout", str(UPGRADE_TIMEOUT_S), "--log", str(server.run_dir / f"{stage}-successor.log"),
               "--", "--hooks", f"omni-{stage}"]
        for option in options:
            cmd += ["--hook-option", option]
        t_up = time.monotonic()
        up = subprocess.run(cmd, capture_output=True, text=True, timeout=UPGRADE_TIMEOUT_S + 30, env=child_env())
        t_done = time.monotonic()
        # Served by the successor: until a request posted after the switch has been answered.
        deadline = time.monotonic() + 120
        while up.returncode == 0 and not any(a[2] > t_done for a in answers):
            assert time.monotonic() < deadline, "no request posted after the upgrade was answered"
            time.sleep(0.05)
    finally:
        stop.set()
        for t in threads:
            t.join(120)
    assert up.returncode == 0, up.stdout + up.stderr
    with SidecarClient(server.endpoint(stage)) as client:
        assert client.status().pid != before  # the successor serves
    assert all(status == 200 for status, *_ in answers), [(s, b[:200]) for s, b, *_ in answers if s != 200]
    want = pcm16(reference)
    for _, body, _, _ in answers:
        assert np.abs(np.frombuffer(body, "<i2").astype(np.int32) - want).max() <= 1
    across = [a for a in answers if a[2] < t_done and a[3] > t_up]
    assert across, "no request ran while the upgrade did"
    assert any(a[2] > t_done for a in answers)  # and some after it
    _, health = server.get("/health")
    assert json.loads(health)["status"] == "ok"  # the successor is adopted, not restarted over


def _in_flight(server, n: int) -> tuple[list[tuple[int, bytes]], list[threading.Thread]]:
    """n speech requests posted from threads, returned once all n run in the talker's engine."""
    answers: list[tuple[int, bytes]] = []

    def post() -> None:
        status, body, _ = server.post({"input": TEXT, "response_format": "pcm", "max_new_tokens": MAX_FRAMES + 1})
        answers.append((status, body))

    threads = [threading.Thread(target=post) for _ in range(n)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 30
    while metric(server, 'omni_serve_stage_requests{stage="talker"}') < n:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    return answers, threads


@pytest.mark.parametrize("stage", ["talker", pytest.param("code2wav", marks=pytest.mark.slow)])  # slow: about 20 s
def test_a_killed_sidecar_fails_its_requests_with_a_503_and_the_server_serves_on(server, reference, stage):
    from omni_serve.speech.pipeline import FOLLOW_TIMEOUT_S
    from omni_sidecar.client import SidecarClient

    with SidecarClient(server.endpoint(stage)) as client:
        pid = client.status().pid
    restarts = json.loads(server.get("/health")[1])["stages"][stage]["sidecar_restarts"]
    answers, threads = _in_flight(server, 3)
    if stage == "code2wav":  # their chunks in flight there too
        deadline = time.monotonic() + 30
        while metric(server, 'omni_serve_stage_requests{stage="code2wav"}') < 1:
            assert time.monotonic() < deadline
            time.sleep(0.01)
    os.kill(pid, signal.SIGKILL)
    killed = time.monotonic()
    for t in threads:
        t.join(120)
    # Failed when the server finds the sidecar dead (it looks every 0.2 s), not when the front end
    # gives up waiting on it (FOLLOW_TIMEOUT_S); the bound leaves a loaded 2-core host room.
    assert time.monotonic() - killed < FOLLOW_TIMEOUT_S / 3
    failed = [json.loads(body)["error"]["message"] for status, body in answers if status == 503]
    assert failed, [status for status, _ in answers]  # in flight when it died: a 503 each
    assert all(stage in m for m in failed), failed
    assert {status for status, _ in answers} <= {200, 503}
    for status, body in answers:  # what was served is whole, the same audio
        if status == 200:
            assert np.abs(np.frombuffer(body, "<i2").astype(np.int32) - pcm16(reference)).max() <= 1
    # Started again, answering, and its engine connected to it: the next request is served, the same audio.
    deadline = time.monotonic() + 60
    while True:
        _, health = server.get("/health")
        state = json.loads(health)
        if state["status"] == "ok" and state["stages"][stage]["sidecar_restarts"] > restarts:
            break
        assert time.monotonic() < deadline, state
        time.sleep(0.2)
    status, pcm, _ = server.post({"input": TEXT, "voice": "vivian", "response_format": "pcm"})
    assert status == 200, pcm
    assert np.abs(np.frombuffer(pcm, "<i2").astype(np.int32) - pcm16(reference)).max() <= 1


def test_models_health_and_metrics(server):
    status, body = server.get("/v1/models")
    assert status == 200
    listed = json.loads(body)["data"]
    assert [m["id"] for m in listed] == ["tiny-tts"] and listed[0]["created"] > 0  # the SDK's Model needs it
    status, body = server.get("/v1/audio/voices")
    assert status == 200 and json.loads(body) == {"voices": ["default", "vivian"], "uploaded_voices": []}
    status, body = server.get("/health")
    assert status == 200 and json.loads(body)["status"] == "ok"
    status, body = server.get("/metrics")
    text = body.decode()
    assert status == 200
    for name in ("omni_serve_time_to_first_audio_seconds_count", "omni_serve_real_time_factor_count",
                 'omni_serve_stage_requests{stage="talker"}', 'omni_serve_stage_requests{stage="code2wav"}'):
        assert name in text, name
    assert metric(server, "omni_serve_time_to_first_audio_seconds_count") >= 4
    assert 0 < metric(server, "omni_serve_real_time_factor_sum")
    # The server's own start-up in its log, in vLLM's format (its loggers are vLLM's children).
    log = server.log.read_text(errors="replace")
    for stage in ("talker", "code2wav"):
        assert f"{stage} sidecar started (pid" in log and f"{stage} engine up:" in log, stage


def _engine_cores(server) -> list:
    import psutil

    return [p for p in psutil.Process(server.proc.pid).children(recursive=True)
            if p.cmdline()[:1] and p.cmdline()[0].startswith("VLLM::EngineCore")]


@pytest.mark.slow  # an engine's restart, about 27 s on 2 cores: `make test-slow`
def test_a_dead_stage_engine_fails_its_requests_with_a_503_and_is_started_again(server, reference):
    cores = _engine_cores(server)
    assert len(cores) == 2, [p.cmdline() for p in cores]  # one per stage
    answers, threads = _in_flight(server, 2)
    cores[0].kill()  # whichever stage's: /health names it
    for t in threads:
        t.join(120)
    assert [status for status, _ in answers] == [503, 503], answers
    deadline = time.monotonic() + 30
    while True:
        status, body = server.get("/health")
        state = json.loads(body)
        down = [name for name, stage in state["stages"].items() if stage["engine"] == "down"]
        if down:
            break
        assert time.monotonic() < deadline, state
        time.sleep(0.1)
    assert status == 503 and state["status"] == "degraded" and len(down) == 1, state
    assert all(stage["sidecar"] == "up" for stage in state["stages"].values()), state
    for _, body in answers:
        message = json.loads(body)["error"]["message"]
        assert f"{down[0]}: its engine failed the request" in message, message
    # Until it is up again, a 503 at once that names the dead stage.
    status, body, _ = server.post({"input": TEXT, "response_format": "pcm"})
    assert status == 503 and f"{down[0]}: its engine failed the request" in json.loads(body)["error"]["message"]
    deadline = time.monotonic() + 180
    while True:
        _, body = server.get("/health")
        state = json.loads(body)
        if state["status"] == "ok":
            break
        assert time.monotonic() < deadline, state
        time.sleep(0.5)
    assert state["stages"][down[0]]["engine_restarts"] == 1, state
    assert metric(server, f'omni_serve_engine_restarts{{stage="{down[0]}"}}') == 1
    status, pcm, _ = server.post({"input": TEXT, "voice": "vivian", "response_format": "pcm"})
    assert status == 200, pcm
    assert np.abs(np.frombuffer(pcm, "<i2").astype(np.int32) - pcm16(reference)).max() <= 1
    assert len(_engine_cores(server)) == 2  # the dead one's place taken, nothing more


LONG_FRAMES = 900  # several seconds of the tiny talker's steps: in flight whenever the server is stopped


def test_a_server_stopped_answers_each_request_in_flight(models, tmp_path):
    """SIGTERM, as an orchestrator stops a server: with --shutdown-timeout 3 a request that finishes
    within it is served whole; those still running then end with a 503 (a whole answer's JSON error, an
    SSE error event; a raw stream cut short, the log saying why), none with a bare 500 or a traceback,
    and the server exits 0, vLLM's IPC sockets gone with the directory it gave them."""
    engine = TINY_ENGINE.replace("max_model_len = 128", f"max_model_len = {LONG_FRAMES + 64}")
    config = _config(tmp_path, *models, max_frames=LONG_FRAMES, talker_engine=engine)
    server_tmp = Path(tempfile.mkdtemp(prefix="omni-tmp-", dir="/tmp"))  # short: vLLM's socket paths are under it
    srv = Server(tmp_path, config, env={"TMPDIR": str(server_tmp), "VLLM_RPC_BASE_PATH": ""},
                 args=("--shutdown-timeout", "3"))
    try:
        long = {"input": TEXT, "response_format": "pcm", "max_new_tokens": LONG_FRAMES}
        answers: dict[str, tuple[int, bytes]] = {}
        started: dict[str, threading.Event] = {name: threading.Event() for name in ("short", "sse", "raw")}

        def call(name: str, body: dict) -> None:
            conn = srv.connection(120.0)
            try:
                conn.request("POST", "/v1/audio/speech", body=json.dumps(body),
                             headers={"Content-Type": "application/json"})
                resp = conn.getresponse()
                first = resp.read1(1 << 16) if body.get("stream") else b""
                if name in started:
                    started[name].set()
                answers[name] = resp.status, first + resp.read()
            finally:
                conn.close()

        threads = [threading.Thread(target=call, args=args) for args in (
            ("whole", long),
            ("sse", {**long, "stream": True}),
            ("raw", {**long, "stream": True, "stream_format": "audio"}),
            ("short", {"input": TEXT, "response_format": "pcm", "stream": True, "stream_format": "audio",
                       "max_new_tokens": 8}))]
        for t in threads:
            t.start()
        for name in ("sse", "raw", "short"):
            assert started[name].wait(120), f"the {name} request never streamed"
        srv.proc.send_signal(signal.SIGTERM)
        stopped_at = time.monotonic()
        for t in threads:
            t.join(60)
        assert srv.proc.wait(60) == 0, srv.tail()
    finally:
        srv.stop()
        rpc_dirs = list(server_tmp.glob("omni-serve-vllm-*"))
        shutil.rmtree(server_tmp, ignore_errors=True)
    took = time.monotonic() - stopped_at
    assert not list(srv.run_dir.glob("*.sock")), "the sidecars' sockets were left behind"
    assert not rpc_dirs, rpc_dirs
    assert sorted(answers) == ["raw", "short", "sse", "whole"], answers.keys()
    status, body = answers["short"]
    assert status == 200 and len(body) == (8 - 1) * 24 * 2  # its whole audio: 8 tokens make 7 frames of 24 samples
    status, body = answers["whole"]
    assert status == 503 and "the server is shutting down" in json.loads(body)["error"]["message"], body
    status, body = answers["sse"]
    events = [json.loads(line[6:]) for line in body.decode().splitlines() if line.startswith("data: ")]
    assert status == 200 and events[-1]["type"] == "speech.audio.error", events[-1:]
    assert "the server is shutting down" in events[-1]["error"]["message"]
    status, body = answers["raw"]
    assert status == 200 and 0 < len(body) < LONG_FRAMES * 24 * 2
    log = srv.log.read_text(errors="replace")
    assert "Traceback" not in log and "Exception in ASGI application" not in log, log[-4000:]
    assert "Shutting down: 3 request(s) still in flight fail" in log, log[-4000:]
    assert took < 40, took  # the drain's 3 s, the answers, the engines' and sidecars' stop

