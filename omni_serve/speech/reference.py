"""A voice-cloning request's reference: the audio whose voice the answer speaks in, and its transcript.

vllm-omni's Qwen3-TTS Base requests name the audio by URI (`ref_audio`): a base64 `data:` URL or an
http(s) URL, fetched and decoded here as vllm-omni's server does it (mono float32 at the file's own
rate, 1 to 30 seconds; its talker resamples for its speaker and codec encoders). Fetched audio is kept
by URI for a while (a WebSocket session names its reference for every utterance).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import http.client
import io
import threading
import urllib.error
import urllib.request
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable

import numpy as np

MIN_SECONDS, MAX_SECONDS = 1.0, 30.0  # vllm-omni's bounds on a reference's length
FETCH_TIMEOUT_S = 10.0
MAX_REFERENCE_BYTES = 32 << 20  # a reference's file, fetched or inline (30 s of 24-bit stereo at 96 kHz: ~17 MiB)
CACHED_REFERENCES = 16  # decoded audio kept by URI (30 s at 24 kHz: ~2.9 MB each)
URI_FORMS = "a base64 data URL (data:audio/wav;base64,...) or an http(s) URL"


ReferenceAudio = Callable[[str], "tuple[np.ndarray, int]"]  # a reference's URI -> (mono float32 samples, rate)


class BadReference(ValueError):
    """Why a request's reference audio cannot be used (a client's fault: a 400)."""


@dataclass(frozen=True)
class VoiceReference:
    """What a voice-cloning request brings: the voice's audio and, for in-context cloning, its transcript."""

    audio: np.ndarray  # [samples] float32, mono
    sample_rate: int
    text: str  # the transcript ("" with x_vector_only)
    x_vector_only: bool  # the speaker embedding alone (no transcript, no reference codes)


_cache: OrderedDict[str, tuple[np.ndarray, int]] = OrderedDict()
_cache_lock = threading.Lock()  # requests resolve their references in worker threads


def reference_audio(uri: str) -> tuple[np.ndarray, int]:
    """(mono float32 samples, sample rate) of the audio `uri` names; BadReference says why not."""
    key = hashlib.sha256(uri.encode()).hexdigest()  # an inline reference's URI is the whole file
    with _cache_lock:
        if key in _cache:
            _cache.move_to_end(key)
            return _cache[key]
    audio = _decoded(_fetched(uri))
    with _cache_lock:
        _cache[key] = audio
        while len(_cache) > CACHED_REFERENCES:
            _cache.popitem(last=False)
    return audio


def _fetched(uri: str) -> bytes:
    scheme = uri.split(":", 1)[0].lower() if ":" in uri else ""
    if scheme == "data":
        header, comma, data = uri.partition(",")
        if not comma or not header.lower().endswith(";base64"):
            raise BadReference(f"ref_audio must be {URI_FORMS}; this data URL is not base64")
        if len(data) > MAX_REFERENCE_BYTES * 4 // 3 + 4:
            raise BadReference(f"ref_audio's data URL holds over {MAX_REFERENCE_BYTES >> 20} MiB")
        try:
            return base64.b64decode(data, validate=True)
        except (binascii.Error, ValueError):
            raise BadReference("ref_audio's data URL is not valid base64") from None
    if scheme in ("http", "https"):
        try:
            with urllib.request.urlopen(uri, timeout=FETCH_TIMEOUT_S) as answer:  # noqa: S310 (scheme checked)
                body = answer.read(MAX_REFERENCE_BYTES + 1)
        except (urllib.error.URLError, http.client.HTTPException, OSError, ValueError) as exc:
            raise BadReference(f"cannot fetch ref_audio from {uri[:200]}: {exc}") from None
        if len(body) > MAX_REFERENCE_BYTES:
            raise BadReference(f"ref_audio at {uri[:200]} is over {MAX_REFERENCE_BYTES >> 20} MiB")
        return body
    raise BadReference(f"ref_audio must be {URI_FORMS}")


def _decoded(data: bytes) -> tuple[np.ndarray, int]:
    import soundfile

    try:
        sound = soundfile.SoundFile(io.BytesIO(data))
    except (soundfile.LibsndfileError, RuntimeError, TypeError, ValueError) as exc:
        raise BadReference(f"ref_audio is not audio this server reads (WAV, FLAC, OGG): {exc}") from None
    with sound:
        # Its length before its samples: a small compressed file may decode to hours of them.
        rate = int(sound.samplerate)
        seconds = sound.frames / rate if rate else 0.0
        if not MIN_SECONDS <= seconds <= MAX_SECONDS:
            raise BadReference(f"ref_audio is {seconds:.2f} s long; a reference is {MIN_SECONDS:.0f} to "
                               f"{MAX_SECONDS:.0f} s")
        try:
            samples = sound.read(dtype="float32", always_2d=True)
        except (soundfile.LibsndfileError, RuntimeError, ValueError) as exc:
            raise BadReference(f"ref_audio could not be decoded: {exc}") from None
    mono = samples.mean(axis=1) if samples.shape[1] > 1 else samples[:, 0]
    return np.ascontiguousarray(mono, dtype=np.float32), rate
