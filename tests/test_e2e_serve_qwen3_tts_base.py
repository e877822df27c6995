"""omni-serve on a Qwen3-TTS Base checkpoint: the voice cloned from a request's reference audio, as vllm-omni
serves it (its own talker and code2wav classes, no patch; a real HTTP client).

The tiny Base checkpoint (tests/tiny_models/qwen3_tts.py `build_base`: a speaker encoder of the talker's
width, a codec encoder of 12.5 frames a second) behind omni_serve/pipelines/qwen3-tts.toml's prompt and
hooks, sized for CPU as tests/test_e2e_serve_qwen3_tts.py sizes them. Greedy: a request's codes are a
function of its prompt, which is how the reference audio and its transcript are seen to reach vllm-omni's
talker (its speaker embedding; in context mode its reference codes too).
"""

from __future__ import annotations

import base64
import io
import json
import math

import numpy as np
import pytest

from tests.support.web import QuietHandler, web_server
from tests.test_e2e_serve_qwen3_tts import FRAMES, SAMPLES_PER_FRAME, TEXT, checkpoint_fixtures

pytestmark = pytest.mark.e2e
RATE = 24000


def _wav(seconds: float, seed: int) -> bytes:
    import soundfile

    noise = np.random.default_rng(seed).uniform(-0.5, 0.5, int(seconds * RATE)).astype(np.float32)
    out = io.BytesIO()
    soundfile.write(out, noise, RATE, format="WAV", subtype="PCM_16")
    return out.getvalue()


def _data_url(wav: bytes) -> str:
    return "data:audio/wav;base64," + base64.b64encode(wav).decode()


def _storage_args(work):
    """Uploaded voices under the test's directory; file:// references from its media directory."""
    (work / "media").mkdir()
    return "--voice-dir", str(work / "voices"), "--allowed-local-media-path", str(work / "media")


model, server = checkpoint_fixtures("build_base", _storage_args)


@pytest.fixture
def web():
    """A local web server for one reference clip (vllm-omni's examples name theirs by https URL)."""
    clip = _wav(1.5, seed=3)

    class Handler(QuietHandler):
        def do_GET(self) -> None:
            found = self.path == "/clone.wav"
            self.send_response(200 if found else 404)
            self.send_header("Content-Type", "audio/wav")
            self.end_headers()
            if found:
                self.wfile.write(clip)

    with web_server(Handler) as url:
        yield url, clip


def _clone(server, **fields) -> tuple[bytes, np.ndarray, np.ndarray | None]:
    """A whole PCM answer, the codes the talker made for it and the reference codes decoded before them."""
    from omni_serve.speech.codes_log import read_codes_log_references

    status, pcm, _ = server.post({"input": TEXT, "response_format": "pcm", **fields})
    assert status == 200, pcm[:1000]
    return pcm, *read_codes_log_references(server.codes_log)[-1][1:]


def test_a_base_checkpoint_speaks_in_the_voice_of_the_reference_audio(server, web):
    assert json.loads(server.get("/v1/audio/voices")[1]) == {"voices": [], "uploaded_voices": []}
    reference = _data_url(_wav(1.5, seed=1))
    icl = {"task_type": "Base", "ref_audio": reference, "ref_text": "A voice to clone."}
    pcm, codes, reference_codes = _clone(server, **icl)
    assert codes.shape == (FRAMES, 4) and ((codes >= 0) & (codes < 64)).all(), codes
    assert len(pcm) == FRAMES * SAMPLES_PER_FRAME * 2 and np.frombuffer(pcm, "<i2").std() > 30
    # In context mode the talker encodes the reference (12.5 frames a second): its codes precede the answer's
    # into code2wav, which never speaks them (the answer is its own frames' samples).
    assert reference_codes is not None and reference_codes.shape == (math.ceil(1.5 * 12.5), 4), reference_codes
    # Greedy: the same reference, the same codes and audio (the OpenAI SDK's voice ignored, as vllm-omni ignores it).
    again, again_codes, again_reference = _clone(server, **icl, voice="alloy")
    assert again == pcm and np.array_equal(again_codes, codes) and np.array_equal(again_reference, reference_codes)
    # The reference reaches the talker: another clip, or another transcript, other codes.
    assert not np.array_equal(_clone(server, **{**icl, "ref_audio": _data_url(_wav(1.5, seed=2))})[1], codes)
    assert not np.array_equal(_clone(server, **{**icl, "ref_text": "Quite another sentence."})[1], codes)
    # The speaker embedding alone (no transcript, no reference codes): other codes again.
    _, x_vector, no_reference = _clone(server, ref_audio=reference, x_vector_only_mode=True)
    assert x_vector.shape == (FRAMES, 4) and not np.array_equal(x_vector, codes) and no_reference is None
    # vllm-omni's usage: an in-context clone reads its reference's codec frames as input tokens too.
    for fields, audio_tokens in ((icl, 19), ({"ref_audio": reference, "x_vector_only_mode": True}, 0)):
        status, sse, _ = server.post({"input": TEXT, "response_format": "pcm", "stream": True, **fields})
        done = json.loads([line for line in sse.decode().splitlines() if line.startswith("data: ")][-1][6:])
        details = done["usage"]["input_token_details"]
        assert status == 200 and details["audio_tokens"] == audio_tokens, done
        assert done["usage"]["input_tokens"] == details["text_tokens"] + audio_tokens > audio_tokens
    # Named by URL, fetched as vllm-omni fetches it: the same answer as the same clip sent inline.
    url, clip = web
    assert _clone(server, **{**icl, "ref_audio": f"{url}/clone.wav"})[1].tolist() == \
        _clone(server, **{**icl, "ref_audio": _data_url(clip)})[1].tolist()


def test_a_base_request_without_a_usable_reference_is_refused_saying_why(server, web):
    url, _ = web
    reference = _data_url(_wav(1.5, seed=1))
    for body, param, needle in (
        ({}, "ref_audio", "ref_audio is required"),
        ({"ref_audio": reference}, "ref_text", "ref_text (the reference audio's transcript) is required"),
        ({"ref_audio": "/tmp/clone.wav", "ref_text": "x"}, "ref_audio", "base64 data URL"),
        ({"ref_audio": [reference], "ref_text": "x"}, "ref_audio", "ref_audio is one"),
        ({"ref_audio": "data:audio/wav;base64,@@@", "ref_text": "x"}, "ref_audio", "not valid base64"),
        ({"ref_audio": _data_url(b"RIFF not a wave"), "ref_text": "x"}, "ref_audio", "not audio"),
        ({"ref_audio": _data_url(_wav(0.5, seed=1)), "ref_text": "x"}, "ref_audio", "0.50 s long"),
        ({"ref_audio": f"{url}/missing.wav", "ref_text": "x"}, "ref_audio", "cannot fetch"),
        ({"ref_audio": reference, "ref_text": "x", "task_type": "CustomVoice"}, "task_type", "it serves 'Base'"),
        ({"ref_audio": reference, "speaker_embedding": [0.5] * 8}, "speaker_embedding", "give one"),
        ({"speaker_embedding": [0.5] * 8}, "speaker_embedding", "8 dimensions; this model's is 128"),
        ({"ref_audio": "file:///etc/hostname", "ref_text": "x"}, "ref_audio", "not under --allowed-local-media-path"),
        ({"voice": "nobody"}, "voice", "unknown voice 'nobody'"),
        ({"ref_audio": "http://[::1/clip.wav", "ref_text": "x"}, "ref_audio", "not a URL this server reads"),
        ({"ref_audio": reference, "ref_text": "\udfff"}, "ref_text", "lone surrogate"),
        # Below the talker's min_tokens: vLLM refuses the talker's request (before, the answer never came).
        ({"ref_audio": reference, "ref_text": "x", "max_new_tokens": 2}, "max_new_tokens", "below the 6 frames"),
    ):
        status, answer, _ = server.post({"input": TEXT, **body})
        error = json.loads(answer)["error"]
        assert status == 400 and needle in error["message"] and error["param"] == param, (body, answer)


def test_a_websocket_session_clones_the_voice_its_config_names(server, web):
    """vllm-omni's streaming-input protocol: session.config carries the reference (fetched once, off the
    event loop), each flush is spoken in its voice, the same audio as POST /v1/audio/speech."""
    from tests.test_e2e_serve import _utterance, _ws

    url, _ = web
    icl = {"ref_audio": f"{url}/clone.wav", "ref_text": "A voice to clone.", "response_format": "pcm"}
    pcm = _clone(server, **icl)[0]
    with _ws(server) as ws:
        ws.send(json.dumps({"type": "session.config", **icl, "stream_audio": True}))
        ws.send(json.dumps({"type": "input.text", "text": TEXT}))
        ws.send(json.dumps({"type": "input.done"}))
        start, audio_bytes, done, _ = _utterance(ws)
        assert start["format"] == "pcm" and audio_bytes == pcm and done["error"] is False, done
        ws.send(json.dumps({"type": "session.config", "response_format": "pcm"}))  # no reference: refused
        assert "ref_audio is required" in json.loads(ws.recv(timeout=60))["message"]


def test_an_uploaded_voice_is_spoken_as_its_clip_sent_inline(server):
    """vllm-omni's voice upload: the clip kept under a name (with its transcript: in-context cloning; without:
    the speaker embedding alone), a Base request that names it answered as one that sends the clip itself."""
    clip = _wav(1.5, seed=5)
    icl = {"ref_audio": _data_url(clip), "ref_text": "A voice to clone."}
    inline_codes = _clone(server, **icl)[1]
    status, answer = server.upload_voice(clip, name="Narrator", consent="consent-1", ref_text="A voice to clone.")
    assert status == 200 and answer["success"] is True, answer
    assert answer["voice"] == {"name": "Narrator", "consent": "consent-1", "created_at": answer["voice"]["created_at"],
                               "mime_type": "audio/wav", "file_size": len(clip), "ref_text": "A voice to clone."}
    listed = json.loads(server.get("/v1/audio/voices")[1])
    assert "narrator" in listed["voices"] and [v["name"] for v in listed["uploaded_voices"]] == ["Narrator"]
    _, codes, reference_codes = _clone(server, voice="NARRATOR")  # any case, as vllm-omni matches it
    assert np.array_equal(codes, inline_codes) and reference_codes is not None
    # Without a transcript: the speaker embedding alone, as a request's x_vector_only_mode.
    assert server.upload_voice(clip, name="whisper", consent="consent-2")[0] == 200
    _, x_vector, no_reference = _clone(server, voice="whisper")
    assert np.array_equal(x_vector, _clone(server, ref_audio=_data_url(clip), x_vector_only_mode=True)[1])
    assert no_reference is None
    # A file under --allowed-local-media-path, named by file:// URL: the same clip, the same answer.
    media = server.log.parent / "media" / "clip.wav"
    media.write_bytes(clip)
    assert np.array_equal(_clone(server, **{**icl, "ref_audio": media.as_uri()})[1], inline_codes)
    # One file a voice, in vllm-omni's layout; a deleted voice is gone from disk and from requests.
    kept = sorted(p.name for p in (server.log.parent / "voices").glob("*.safetensors"))
    assert len(kept) == 2 and kept[0].startswith("Narrator_consent-1_"), kept
    assert server.delete("/v1/audio/voices/narrator")[0] == 200
    assert server.delete("/v1/audio/voices/narrator")[0] == 404
    status, body, _ = server.post({"input": TEXT, "voice": "narrator"})
    assert status == 400 and json.loads(body)["error"]["param"] == "voice", body
    assert len(list((server.log.parent / "voices").glob("*.safetensors"))) == 1
    assert server.delete("/v1/audio/voices/whisper")[0] == 200


def test_an_upload_that_cannot_be_kept_is_refused_saying_why(server):
    clip = _wav(1.5, seed=6)
    for clip_sent, fields, param, needle in (
        (clip, {"consent": "c"}, "name", "name is required"),
        (clip, {"name": "x"}, "consent", "consent is required"),
        (None, {"name": "x", "consent": "c"}, "audio_sample", "audio_sample (the voice's audio file) or"),
        (clip, {"name": "../x", "consent": "c"}, "name", "not a voice name"),
        (b"RIFF not a wave", {"name": "x", "consent": "c"}, "audio_sample", "not audio"),
        (_wav(0.5, seed=6), {"name": "x", "consent": "c"}, "audio_sample", "0.50 s long"),
        (clip, {"name": "x", "consent": "c", "speaker_embedding": "[0.5]"}, "speaker_embedding", "give one"),
        (None, {"name": "x", "consent": "c", "speaker_embedding": "[0.5]"}, "speaker_embedding", "1 dimensions"),
        (None, {"name": "x", "consent": "c", "speaker_embedding": "[0.5, NaN"}, "speaker_embedding", "must be JSON"),
        (clip, {"name": "x", "consent": "c", "language": "English"}, "language", "not a voice upload's field"),
    ):
        status, answer = server.upload_voice(clip_sent, **fields)
        assert status == 400 and needle in answer["error"]["message"] and answer["error"]["param"] == param, \
            (fields, answer)
    assert json.loads(server.get("/v1/audio/voices")[1])["uploaded_voices"] == []


def test_a_voice_given_as_its_speaker_embedding_is_spoken_in_it(server):
    """vllm-omni's precomputed voice: `speaker_embedding` (the talker's width) instead of audio, the embedding
    alone; uploaded as one (`speaker_embedding`, a JSON list), the voice that names it is the same."""
    vector = np.random.default_rng(7).normal(size=128).round(4).tolist()
    _, codes, no_reference = _clone(server, speaker_embedding=vector)
    assert codes.shape == (FRAMES, 4) and no_reference is None
    assert np.array_equal(_clone(server, speaker_embedding=vector)[1], codes)  # greedy: the same voice, the same codes
    other = np.random.default_rng(8).normal(size=128).round(4).tolist()
    assert not np.array_equal(_clone(server, speaker_embedding=other)[1], codes)  # it reaches the talker
    status, answer = server.upload_voice(None, name="Vector", consent="consent-3", speaker_embedding=json.dumps(vector))
    assert status == 200 and answer["voice"] == {"name": "Vector", "consent": "consent-3", "embedding_source": "direct",
                                                 "embedding_dim": 128, "created_at": answer["voice"]["created_at"]}
    [listed] = json.loads(server.get("/v1/audio/voices")[1])["uploaded_voices"]
    assert (listed["embedding_source"], listed["embedding_dim"], listed["mime_type"]) == \
        ("direct", 128, "application/x-safetensors")
    assert np.array_equal(_clone(server, voice="vector")[1], codes)
    assert server.delete("/v1/audio/voices/Vector")[0] == 200
