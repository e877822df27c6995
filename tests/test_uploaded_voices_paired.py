"""Uploaded voices: a directory vllm-omni's speech server wrote is served by omni-serve, and the other way
round. vllm-omni's own `upload_voice`, `upload_voice_embedding`, `_restore_uploaded_speakers` and loaders
(tests/support/uploaded_voices_job.py, a process of its own) against omni_serve/speech/voices.py. Its
serving module imports only beside the vLLM it was built for: `make test-paired`, skipped elsewhere.
"""

from __future__ import annotations

import io
import json
import subprocess
import sys

import numpy as np

from tests.support.paired_vllm_omni import paired_pythonpath, skip_unless_paired
from tests.support.procs import ROOT, child_env

RATE = 16000


def _clip(seed: int) -> bytes:
    import soundfile

    out = io.BytesIO()
    noise = np.random.default_rng(seed).uniform(-0.5, 0.5, int(1.5 * RATE)).astype(np.float32)
    soundfile.write(out, noise, RATE, format="WAV", subtype="FLOAT")
    return out.getvalue()


def _read_by_vllm_omni(directory, plan: dict) -> dict:
    """vllm-omni uploads the plan's voices into the directory, then reads every voice there."""
    plan_path, result_path = directory.parent / "plan.json", directory.parent / "read.json"
    plan_path.write_text(json.dumps(plan))
    done = subprocess.run([sys.executable, "-m", "tests.support.uploaded_voices_job", str(directory), str(plan_path),
                           str(result_path)], env=child_env(PYTHONPATH=paired_pythonpath()), cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(result_path.read_text())


def test_voices_uploaded_to_either_server_are_read_by_the_other(tmp_path):
    from omni_serve.speech.voices import UploadedVoices

    skip_unless_paired()
    directory = tmp_path / "voices"
    ours = UploadedVoices(directory, limit=10)
    narrator = ours.add("Narrator", "consent-1", _clip(1), "narrator.wav", "audio/wav", "A voice to clone.")
    ours.add_embedding("Ours", "consent-3", np.linspace(-1, 1, 16))
    (tmp_path / "reader.wav").write_bytes(_clip(2))
    their_vector = [0.25 * i for i in range(16)]
    read = _read_by_vllm_omni(directory, {"clips": [[str(tmp_path / "reader.wav"), "Reader", "consent-2",
                                                    "Another voice."]],
                                         "embeddings": [["Theirs", "consent-4", their_vector]]})

    # vllm-omni reads ours: the clip, its rate and its transcript; the embedding.
    assert set(read) == {"narrator", "ours", "reader", "theirs"}
    assert read["narrator"]["ref_text"] == "A voice to clone." and read["narrator"]["rate"] == RATE
    assert np.array_equal(np.asarray(read["narrator"]["samples"], np.float32), ours.clip(narrator)[0])
    assert read["ours"]["embedding_source"] == "direct"
    assert np.allclose(read["ours"]["embedding"], np.linspace(-1, 1, 16))

    # Ours reads vllm-omni's: the same samples its own reader gives, its embedding.
    again = UploadedVoices(directory, limit=10)
    assert again.restore() == (4, [])
    reader = again.get("reader")
    assert (reader.name, reader.consent, reader.ref_text, reader.sample_rate) == \
        ("Reader", "consent-2", "Another voice.", RATE)
    samples, rate = again.clip(reader)
    assert rate == RATE and np.array_equal(samples, np.asarray(read["reader"]["samples"], np.float32))
    theirs = again.get("theirs")
    assert (theirs.embedding_source, theirs.embedding_dim, theirs.file_size > 0) == ("direct", 16, True)
    assert again.embedding(theirs).tolist() == their_vector
