"""Uploaded voices: a directory vllm-omni's speech server wrote is served by omni-serve, and the other way
round. vllm-omni's own `upload_voice`, `_restore_uploaded_speakers` and `_load_uploaded_audio` (its
serving module imported, its package's __init__ and patches not run) against omni_serve/speech/voices.py.
Its serving module imports only beside the vLLM it was built for: `make test-paired`, skipped elsewhere.
"""

from __future__ import annotations

import asyncio
import importlib
import io
import sys

import numpy as np
import pytest

from tests.support.paired_vllm_omni import VLLM_OMNI, skip_unless_paired
from tests.support.procs import ROOT

RATE = 16000


def _clip(seed: int) -> bytes:
    import soundfile

    out = io.BytesIO()
    noise = np.random.default_rng(seed).uniform(-0.5, 0.5, int(1.5 * RATE)).astype(np.float32)
    soundfile.write(out, noise, RATE, format="WAV", subtype="FLOAT")
    return out.getvalue()


@pytest.fixture(scope="module")
def serving_speech():
    """vllm-omni's speech serving class; its modules gone from sys.modules after."""
    from worker_shim.omni_models.package import stand_in_module

    skip_unless_paired()
    stub = str(ROOT / "tests" / "support" / "torchaudio_stub")  # its audio mixin imports torchaudio
    saved = {n: m for n, m in sys.modules.items() if n == "vllm_omni" or n.startswith("vllm_omni.")}
    for name in saved:
        del sys.modules[name]
    sys.modules["vllm_omni"] = stand_in_module(VLLM_OMNI / "vllm_omni")
    for sub in ("entrypoints", "entrypoints.openai"):  # their __init__s import its whole API server
        module = stand_in_module(VLLM_OMNI / "vllm_omni" / sub.replace(".", "/"))
        module.__name__ = f"vllm_omni.{sub}"
        sys.modules[f"vllm_omni.{sub}"] = module
    sys.path.insert(0, stub)
    try:
        yield importlib.import_module("vllm_omni.entrypoints.openai.serving_speech").OmniOpenAIServingSpeech
    finally:
        sys.path.remove(stub)
        for name in [n for n in sys.modules if n == "vllm_omni" or n.startswith("vllm_omni.")]:
            del sys.modules[name]
        sys.modules.update(saved)


def _vllm_omni_store(cls, directory):
    """vllm-omni's server as far as its voice store goes: the attributes its __init__ sets for it."""
    server = object.__new__(cls)
    server.uploaded_speakers_dir = directory
    server.uploaded_speakers = {}
    server.supported_speakers = set()
    server._last_upload_ts = 0
    server._max_uploaded_speakers = 1000
    server._upload_lock = asyncio.Lock()
    server._ref_audio_data_url_cache = {}
    server._tts_model_type = "qwen3_tts_without_an_engine"  # its embedding width check needs an engine: skipped
    return server


def test_voices_uploaded_to_either_server_are_read_by_the_other(serving_speech, tmp_path):
    from starlette.datastructures import Headers, UploadFile

    from omni_serve.speech.voices import UploadedVoices

    ours = UploadedVoices(tmp_path, limit=10)
    kept = ours.add("Narrator", "consent-1", _clip(1), "narrator.wav", "audio/wav", "A voice to clone.")
    theirs = _vllm_omni_store(serving_speech, tmp_path)
    asyncio.run(theirs.upload_voice(UploadFile(io.BytesIO(_clip(2)), filename="reader.wav",
                                               headers=Headers({"content-type": "audio/wav"})),
                                    "consent-2", "Reader", ref_text="Another voice."))

    # vllm-omni reads ours: the clip, its rate and its transcript.
    restored = _vllm_omni_store(serving_speech, tmp_path)
    restored._restore_uploaded_speakers()
    assert set(restored.uploaded_speakers) == {"narrator", "reader"}
    assert restored.uploaded_speakers["narrator"]["ref_text"] == "A voice to clone."
    samples, rate = restored._load_uploaded_audio("Narrator")
    assert rate == RATE and np.array_equal(samples, ours.clip(kept)[0])

    # Ours reads vllm-omni's: the same samples its own reader gives.
    again = UploadedVoices(tmp_path, limit=10)
    assert again.restore() == (2, [])
    reader = again.get("reader")
    assert (reader.name, reader.consent, reader.ref_text, reader.sample_rate) == \
        ("Reader", "consent-2", "Another voice.", RATE)
    their_samples, their_rate = restored._load_uploaded_audio("reader")
    our_samples, our_rate = again.clip(reader)
    assert our_rate == their_rate == RATE and np.array_equal(our_samples, their_samples.astype(np.float32))


def test_voices_uploaded_as_speaker_embeddings_are_read_by_either_server(serving_speech, tmp_path):
    import json

    from omni_serve.speech.voices import UploadedVoices

    ours = UploadedVoices(tmp_path, limit=10)
    ours.add_embedding("Ours", "consent-1", np.linspace(-1, 1, 16))
    theirs = _vllm_omni_store(serving_speech, tmp_path)
    their_vector = [0.25 * i for i in range(16)]
    asyncio.run(theirs.upload_voice_embedding(json.dumps(their_vector), "consent-2", "Theirs"))

    restored = _vllm_omni_store(serving_speech, tmp_path)
    restored._restore_uploaded_speakers()
    assert restored.uploaded_speakers["ours"]["embedding_source"] == "direct"
    assert np.allclose(restored._get_uploaded_speaker_embedding("Ours"), np.linspace(-1, 1, 16))

    again = UploadedVoices(tmp_path, limit=10)
    assert again.restore() == (2, [])
    voice = again.get("theirs")
    assert (voice.embedding_source, voice.embedding_dim, voice.file_size > 0) == ("direct", 16, True)
    assert again.embedding(voice).tolist() == their_vector
