"""omni-serve as a Qwen3-TTS user runs it: vllm-omni's own talker and code2wav classes (no patch) on a
CustomVoice checkpoint of the published layout, omni_serve/pipelines/qwen3-tts.toml's stages and speech prompt
(`Qwen3TTSPrompt`) sized for CPU, a real HTTP client.

vllm-omni's talker decodes on CPU through the shim's platform for it (worker_shim/omni_models/
cpu_platform.py); the tiny checkpoint is tests/tiny_models/qwen3_tts.py's with three speakers and four
languages (random weights: the audio is noise, the plumbing real). Greedy talker and code predictor:
a request's codes are a function of its prompt, which is how the voice, language and instructions
are seen to reach vllm-omni's prompt builder.
"""

from __future__ import annotations

import base64
import io
import json
import subprocess
import sys
import tomllib
import wave
from pathlib import Path
from typing import Callable

import numpy as np
import pytest

from tests.support.procs import ROOT, child_env
from tests.support.serve import serving
from tests.support.vllm_omni_payload import installed_vllm_omni

pytestmark = pytest.mark.e2e
TOKENS = 6  # every request's: min_tokens masks the codec's EOS until then, max_tokens stops there
# A frame per token but the last: vllm-omni's code predictor completes a token's frame in the step that
# feeds it back, which a request stopped at max_tokens never runs.
FRAMES = TOKENS - 1
SAMPLES_PER_FRAME = 8  # the tiny codec's decoder upsampling
TEXT = "Hello there"
ENGINE = ('max_num_seqs = 4, dtype = "float32", enforce_eager = true, seed = 0, kv_cache_memory_bytes = 33554432, '
          'max_model_len = 256, max_num_batched_tokens = 256')


def _env() -> dict[str, str]:
    vllm_omni = installed_vllm_omni()
    path = [str(ROOT), str(vllm_omni), str(ROOT / "tests" / "support" / "torchaudio_stub")]
    return {"PYTHONPATH": ":".join(path), "VLLM_PLUGINS": "omni_sidecar_shim"}


def _config(work: Path, model: Path) -> Path:
    """omni_serve/pipelines/qwen3-tts.toml's prompt, registration and hooks on the tiny checkpoint, sized for CPU."""
    shipped = tomllib.loads((ROOT / "omni_serve" / "pipelines" / "qwen3-tts.toml").read_text())
    eos = json.loads((model / "config.json").read_text())["talker_config"]["codec_eos_token_id"]
    options = dict(shipped["stages"]["code2wav"]["sidecar"]["options"], chunk_frames="4", left_context="8",
                   codebook_size="64")
    path = work / "serve.toml"
    path.write_text(f'''
served_model_name = "qwen3-tts-tiny"
max_input_chars = 200
speech_prompt = {json.dumps(shipped["speech_prompt"])}
register = {json.dumps(shipped["register"])}
sample_rate = {shipped["sample_rate"]}

[stages.talker]
model = "{model}"
max_tokens = {TOKENS}
engine = {{ {ENGINE}, additional_config = {{ omni_sidecar = {{ subtalker_sampling = {{ do_sample = false }} }} }} }}
sampling = {{ temperature = 0.0, min_tokens = {TOKENS}, stop_token_ids = [{eos}], detokenize = false }}
sidecar = {{ hooks = {json.dumps(shipped["stages"]["talker"]["sidecar"]["hooks"])} }}

[stages.code2wav]
model = "{model}"
placeholder_token = {shipped["stages"]["code2wav"]["placeholder_token"]}
engine = {{ {ENGINE}, hf_overrides = {{ architectures = ["Qwen3TTSCode2Wav"] }} }}
sidecar = {{ hooks = "omni-code2wav", options = {{ {", ".join(f'{k} = "{v}"' for k, v in options.items())} }} }}
''')
    return path


def checkpoint_fixtures(builder: str, args: Callable[[Path], tuple[str, ...]] = lambda work: ()):
    """A module's `model` (a tiny checkpoint of tests/tiny_models/qwen3_tts.py's `builder`, built in a child:
    vLLM's state stays there) and `server` (omni-serve on it, this module's config; `args`: more options,
    given the server's work directory) fixtures."""

    @pytest.fixture(scope="module")
    def model(tmp_path_factory) -> Path:
        path = tmp_path_factory.mktemp(f"qwen3-tts-{builder}") / "model"
        done = subprocess.run([sys.executable, "-c", "import sys; from tests.tiny_models import qwen3_tts; "
                               f"qwen3_tts.{builder}(sys.argv[1])", str(path)],
                              env=child_env(**_env()), cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        return path

    @pytest.fixture(scope="module")
    def server(model, tmp_path_factory):
        work = tmp_path_factory.mktemp("serve-qwen3-tts")
        with serving(work, _config(work, model), _env(), args(work)) as srv:
            yield srv

    return model, server


model, server = checkpoint_fixtures("build_custom_voice")


def _speak(server, **fields) -> tuple[np.ndarray, np.ndarray, int]:
    """Over vllm-omni's SSE stream: the PCM samples, the codes the talker made and the usage's input tokens."""
    from omni_serve.speech.codes_log import read_codes_log

    status, sse, kind = server.post({"input": TEXT, "response_format": "pcm", "stream": True, **fields})
    assert status == 200 and kind.startswith("text/event-stream"), sse[:1000]
    events = [json.loads(line[6:]) for line in sse.decode().splitlines() if line.startswith("data: ")]
    assert events[-1]["type"] == "speech.audio.done", events[-1]
    pcm = b"".join(base64.b64decode(e["audio"]) for e in events if e["type"] == "speech.audio.delta")
    return np.frombuffer(pcm, dtype="<i2"), read_codes_log(server.codes_log)[-1][1], events[-1]["usage"]["input_tokens"]


def test_the_voices_and_languages_are_the_checkpoints(server):
    from tests.tiny_models.qwen3_tts import CUSTOM_VOICES

    status, body = server.get("/v1/audio/voices")
    assert status == 200 and json.loads(body) == {"voices": sorted(CUSTOM_VOICES), "uploaded_voices": []}
    status, body = server.get("/v1/models")
    # vllm-omni's default speaker first (the default voice here), then the checkpoint's order.
    assert list(CUSTOM_VOICES) == ["ryan", "vivian", "eric"]
    assert json.loads(body)["data"][0]["voices"] == ["vivian", "ryan", "eric"]
    status, body, _ = server.post({"input": TEXT, "language": "klingon"})
    message = json.loads(body)["error"]["message"]
    assert status == 400 and "supported: Auto, Chinese, English, German, Sichuan_Dialect" in message, message
    status, body, _ = server.post({"input": TEXT, "voice": "alice"})
    assert status == 400 and "voices: vivian, ryan, eric" in json.loads(body)["error"]["message"]
    status, body, _ = server.post({"input": TEXT, "instructions": "x" * 501})
    assert status == 400 and "at most 500" in json.loads(body)["error"]["message"]
    # A prompt past the talker's max_model_len (256) is the request's: a 400, as vllm-omni answers it.
    status, body, _ = server.post({"input": "x" * 200, "instructions": "y" * 60})
    assert status == 400 and "makes a prompt of" in json.loads(body)["error"]["message"], body
    status, body, _ = server.post({"input": TEXT, "task_type": "Base"})
    assert status == 400 and "task_type" in json.loads(body)["error"]["message"]
    # Voices are uploaded for a Base checkpoint's cloning: this one speaks its own.
    status, answer = server.upload_voice(b"RIFF", name="mine", consent="c")
    assert status == 400 and "does not clone voices" in answer["error"]["message"], answer


def test_vllm_omnis_talker_and_codec_make_each_requests_audio_from_its_voice_language_and_instructions(server):
    samples, codes, input_tokens = _speak(server, voice="Ryan", language="english", instructions="Speak slowly.")
    assert codes.shape == (FRAMES, 4) and ((codes >= 0) & (codes < 64)).all(), codes  # codes, never a special
    assert samples.size == FRAMES * SAMPLES_PER_FRAME and samples.std() > 30, samples  # noise, not silence
    again, same_codes, _ = _speak(server, voice="ryan", language="English", instructions="Speak slowly.")
    np.testing.assert_array_equal(same_codes, codes)  # greedy: the same prompt, the same codes and audio
    np.testing.assert_array_equal(again, samples)
    # vllm-omni's usage: the input's tokens and the instructions' (the tiny tokenizer: a token a byte).
    _, english_codes, english = _speak(server, voice="ryan", language="English")
    assert (english, input_tokens) == (len(TEXT), len(TEXT) + len("Speak slowly.")), (english, input_tokens)
    # Under Auto a dialect speaker speaks his dialect (vllm-omni's spk_is_dialect rule): one prompt, one audio.
    eric_codes = _speak(server, voice="eric")[1]
    np.testing.assert_array_equal(eric_codes, _speak(server, voice="eric", language="sichuan_dialect")[1])
    # Each field reaches vllm-omni's prompt: another speaker's row, language tag or no instructions, other codes.
    assert not np.array_equal(_speak(server, voice="vivian", language="English")[1], english_codes)
    assert not np.array_equal(_speak(server, voice="ryan", language="German")[1], english_codes)
    assert not np.array_equal(english_codes, codes)


def test_a_whole_wav_carries_the_streams_samples_and_no_voice_is_vllm_omnis_default_speaker(server):
    streamed, _, _ = _speak(server)
    status, body, kind = server.post({"input": TEXT, "voice": "Vivian"})
    assert status == 200 and kind == "audio/wav", body[:500]
    with wave.open(io.BytesIO(body)) as w:
        assert (w.getframerate(), w.getnchannels(), w.getsampwidth()) == (24000, 1, 2)
        np.testing.assert_array_equal(np.frombuffer(w.readframes(w.getnframes()), dtype="<i2"), streamed)


def _as_kind(model: Path, where: Path, kind: str) -> Path:
    """The checkpoint as another published kind (config.json's tts_model_type, no speakers): its files linked."""
    where.mkdir()
    for item in model.iterdir():
        if item.name != "config.json":
            (where / item.name).symlink_to(item)
    config = json.loads((model / "config.json").read_text())
    config["tts_model_type"] = kind
    config["talker_config"]["spk_id"] = config["talker_config"]["spk_is_dialect"] = {}
    (where / "config.json").write_text(json.dumps(config))
    return where


# A server of its own (a minute on CI's two cores): `make test-slow`. What differs from CustomVoice (no
# voices, instructions required, a voice ignored) is tests/test_serve_units.py's DescribedVoicePrompt's too.
@pytest.mark.slow
def test_a_voice_design_checkpoint_speaks_the_voice_its_instructions_describe(model, tmp_path):
    """vllm-omni's VoiceDesign: no voices; `instructions` describe the voice (required), a voice named is ignored."""
    from omni_serve.speech.codes_log import read_codes_log

    voice_design = _as_kind(model, tmp_path / "voice-design", "voice_design")
    with serving(tmp_path, _config(tmp_path, voice_design), _env()) as server:
        assert json.loads(server.get("/v1/audio/voices")[1]) == {"voices": [], "uploaded_voices": []}
        described = {"input": TEXT, "task_type": "VoiceDesign", "instructions": "A warm, low voice."}
        status, pcm, _ = server.post({**described, "response_format": "pcm"})
        assert status == 200, pcm[:1000]
        codes = read_codes_log(server.codes_log)[-1][1]
        assert codes.shape == (FRAMES, 4) and len(pcm) == FRAMES * SAMPLES_PER_FRAME * 2
        # The OpenAI SDK always names a voice: ignored, as vllm-omni ignores it here; other instructions, other codes.
        assert server.post({**described, "voice": "alloy", "response_format": "pcm"})[1] == pcm
        server.post({**described, "instructions": "A bright, fast voice.", "response_format": "pcm"})
        assert not np.array_equal(read_codes_log(server.codes_log)[-1][1], codes)
        for body, needle in (({"input": TEXT}, "instructions are required"),
                             ({**described, "task_type": "CustomVoice"}, "it serves 'VoiceDesign'")):
            status, answer, _ = server.post(body)
            assert status == 400 and needle in json.loads(answer)["error"]["message"], answer


def test_a_checkpoint_it_cannot_serve_is_refused_at_start_with_one_line(model, tmp_path):
    """A CustomVoice checkpoint without speakers has no voice to speak in: omni-serve stops before any engine
    starts, saying so."""
    speakerless = _as_kind(model, tmp_path / "speakerless", "custom_voice")
    # The built-in pipeline, as a user names it, on this checkpoint; VLLM_PLUGINS unset, as a user may leave it.
    env = {k: v for k, v in child_env(**_env()).items() if k != "VLLM_PLUGINS"}
    done = subprocess.run([sys.executable, "-m", "omni_serve", "--pipeline", "qwen3-tts", "--model", str(speakerless),
                           "--run-dir", str(tmp_path / "run")], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr[-3000:]
    assert "vllm-omni is installed: VLLM_PLUGINS=omni_sidecar_shim" in done.stderr  # its patches kept out
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("omni-serve: ") and "custom_voice checkpoint without built-in speakers" in last, last
    assert "serves CustomVoice, VoiceDesign and Base checkpoints" in last and not list((tmp_path / "run").glob("*.sock"))
