"""A voice-cloning request's reference: the audio whose voice the answer speaks in, and its transcript.

vllm-omni's Qwen3-TTS Base requests name the audio by URI (`ref_audio`): a base64 `data:` URL, an
http(s) URL or, where the operator allows a directory (`--allowed-local-media-path`, vLLM's option), a
`file://` URL under it; fetched and decoded here as vllm-omni's server does it (vLLM's MediaConnector
rules: `--allowed-media-domains` limits the hosts fetched from; mono float32 at the file's own rate,
1 to 30 seconds; its talker resamples for its speaker and codec encoders). Fetched audio is kept by URI
for a while (a WebSocket session names its reference for every utterance).
"""

from __future__ import annotations

import base64
import binascii
import concurrent.futures
import hashlib
import http.client
import io
import os
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import numpy as np

MIN_SECONDS, MAX_SECONDS = 1.0, 30.0  # vllm-omni's bounds on a reference's length
FETCH_TIMEOUT_S = 10.0  # a fetch's wait for the server to answer or send more
FETCH_DEADLINE_S = 30.0  # a whole fetch (a server that trickles its answer holds a worker thread no longer)
MAX_REFERENCE_BYTES = 32 << 20  # a reference's file, fetched or inline (30 s of 24-bit stereo at 96 kHz: ~17 MiB)
# Samples a file may decode to (all channels): 30 s of stereo at 96 kHz. A small compressed file can
# declare many channels at a high rate; past this it is refused before its samples are read.
MAX_DECODED_SAMPLES = 30 * 96_000 * 2
CACHED_REFERENCES = 16  # decoded audio kept by URI (mono, at most 30 s at 96 kHz: ~11 MB each; 2.9 MB at 24 kHz)
FETCHED_SCHEMES = ("http", "https")
URI_FORMS = "a base64 data URL (data:audio/wav;base64,...), an http(s) URL or a file:// URL"


class BadReference(ValueError):
    """Why a request's reference audio cannot be used (a client's fault: a 400)."""


@dataclass(frozen=True)
class VoiceReference:
    """What a voice-cloning request brings: the voice's audio and, for in-context cloning, its transcript;
    or the voice's speaker embedding itself (precomputed: no audio, the embedding alone)."""

    audio: np.ndarray | None  # [samples] float32, mono; None with a speaker embedding
    sample_rate: int
    text: str  # the transcript ("" with x_vector_only)
    x_vector_only: bool  # the speaker embedding alone (no transcript, no reference codes)
    speaker_embedding: np.ndarray | None = None  # [the talker's width] float32, given instead of audio
    voice: tuple[str, int] | None = None  # an uploaded voice's (name, time of upload): the talker caches by it


class References:
    """Where a request's reference audio may come from (vLLM's `--allowed-local-media-path` and
    `--allowed-media-domains`), and the audio fetched lately, by URI."""

    def __init__(self, local_root: Path | None = None, domains: tuple[str, ...] = ()) -> None:
        self.local_root = local_root.resolve() if local_root is not None else None
        self.domains = tuple(domain.lower() for domain in domains)  # empty: any host
        self._cache: OrderedDict[str, tuple[np.ndarray, int]] = OrderedDict()
        self._pending: dict[str, concurrent.futures.Future[tuple[np.ndarray, int]]] = {}  # fetches under way
        self._lock = threading.Lock()  # requests resolve their references in worker threads
        self._opener = urllib.request.build_opener(_KeptToDomains(self))

    def audio(self, uri: str) -> tuple[np.ndarray, int]:
        """(mono float32 samples, sample rate) of the audio `uri` names; BadReference says why not. Requests
        that name one URI at once (a batch's shared reference) wait for one fetch."""
        key = hashlib.sha256(uri.encode("utf-8", "surrogatepass")).hexdigest()  # an inline URI is the whole file
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
            pending = self._pending.get(key)
            fetching = pending is None
            if pending is None:
                pending = self._pending[key] = concurrent.futures.Future()
        if not fetching:
            return pending.result()  # the fetch's audio, or its BadReference raised again
        try:
            audio = decoded(self._fetched(uri))
        except BaseException as exc:
            with self._lock:
                del self._pending[key]
            pending.set_exception(exc)
            raise
        with self._lock:  # cached as it stops being pending: a request that comes now finds one or the other
            del self._pending[key]
            self._cache[key] = audio
            while len(self._cache) > CACHED_REFERENCES:
                self._cache.popitem(last=False)
        pending.set_result(audio)
        return audio

    def check_url(self, url: str) -> None:
        """An http(s) URL from a host the references may be fetched from (any, without a list)."""
        parts = _url_parts(url)
        if parts.scheme.lower() not in FETCHED_SCHEMES:
            raise BadReference(f"ref_audio led to a {parts.scheme or 'schemeless'} URL; this server fetches only "
                               "http(s)")
        if not self.domains:
            return
        if "@" in parts.netloc or "\\" in parts.netloc:  # a host the check and the connection might read apart
            raise BadReference("ref_audio's URL carries credentials or a backslash in its host part")
        host = (parts.hostname or "").lower()
        if host not in self.domains:
            raise BadReference(f"ref_audio's host {host!r} is not one this server fetches from "
                               f"(--allowed-media-domains: {', '.join(self.domains)})")

    def _fetched(self, uri: str) -> bytes:
        scheme = uri.split(":", 1)[0].lower() if ":" in uri else ""
        if scheme == "data":
            return _inline(uri)
        if scheme in FETCHED_SCHEMES:
            self.check_url(uri)
            try:
                return self._download(uri)
            except BadReference:
                raise
            except (urllib.error.URLError, http.client.HTTPException, OSError, ValueError) as exc:
                raise BadReference(f"cannot fetch ref_audio from {uri[:200]}: {exc}") from None
        if scheme == "file":
            return self._local(uri)
        raise BadReference(f"ref_audio must be {URI_FORMS}")

    def _download(self, uri: str) -> bytes:
        deadline = time.monotonic() + FETCH_DEADLINE_S
        body = bytearray()
        with self._opener.open(uri, timeout=FETCH_TIMEOUT_S) as answer:
            while chunk := answer.read(1 << 16):
                body += chunk
                if len(body) > MAX_REFERENCE_BYTES:
                    raise BadReference(f"ref_audio at {uri[:200]} is over {MAX_REFERENCE_BYTES >> 20} MiB")
                if time.monotonic() > deadline:
                    raise BadReference(f"ref_audio at {uri[:200]} took over {FETCH_DEADLINE_S:.0f} s to fetch")
        return bytes(body)

    def _local(self, uri: str) -> bytes:
        if self.local_root is None:
            raise BadReference("ref_audio names a local file, which this server reads only under a directory its "
                               "operator allows (--allowed-local-media-path)")
        parts = _url_parts(uri)
        if parts.netloc not in ("", "localhost"):
            raise BadReference(f"ref_audio's file URL names another host ({parts.netloc[:100]!r})")
        try:
            path = Path(os.path.realpath(urllib.request.url2pathname(parts.path)))  # links followed, then checked
        except ValueError as exc:  # a NUL in the path
            raise BadReference(f"ref_audio's file URL is not a path: {exc}") from None
        if self.local_root not in path.parents:
            raise BadReference(f"ref_audio's file {str(path)[:200]} is not under --allowed-local-media-path "
                               f"{self.local_root}")
        try:
            with open(path, "rb") as file:
                body = file.read(MAX_REFERENCE_BYTES + 1)
        except OSError as exc:
            raise BadReference(f"cannot read ref_audio's file {str(path)[:200]}: {exc.strerror or exc}") from None
        if len(body) > MAX_REFERENCE_BYTES:
            raise BadReference(f"ref_audio's file {str(path)[:200]} is over {MAX_REFERENCE_BYTES >> 20} MiB")
        return body


def _url_parts(url: str) -> urllib.parse.SplitResult:
    try:
        parts = urllib.parse.urlsplit(url)
        parts.hostname  # noqa: B018 (a bracketed host is checked when read)
    except ValueError as exc:
        raise BadReference(f"ref_audio is not a URL this server reads: {exc}") from None
    return parts


class _KeptToDomains(urllib.request.HTTPRedirectHandler):
    """A redirect is followed only to an http(s) URL of a host the references may be fetched from."""

    def __init__(self, references: References) -> None:
        self.references = references

    def redirect_request(self, req, fp, code, msg, headers, newurl):  # noqa: ANN001 (urllib's signature)
        self.references.check_url(newurl)
        return super().redirect_request(req, fp, code, msg, headers, newurl)


def _inline(uri: str) -> bytes:
    header, comma, data = uri.partition(",")
    if not comma or not header.lower().endswith(";base64"):
        raise BadReference(f"ref_audio must be {URI_FORMS}; this data URL is not base64")
    if len(data) > MAX_REFERENCE_BYTES * 4 // 3 + 4:
        raise BadReference(f"ref_audio's data URL holds over {MAX_REFERENCE_BYTES >> 20} MiB")
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise BadReference("ref_audio's data URL is not valid base64") from None


def decoded(data: bytes, what: str = "ref_audio") -> tuple[np.ndarray, int]:
    """A reference's file as (mono float32 samples, its rate), 1 to 30 s long; BadReference says why not."""
    import soundfile

    try:
        sound = soundfile.SoundFile(io.BytesIO(data))
    except (soundfile.LibsndfileError, RuntimeError, TypeError, ValueError) as exc:
        raise BadReference(f"{what} is not audio this server reads (WAV, FLAC, OGG, MP3): {exc}") from None
    with sound:
        # Its length before its samples: a small compressed file may decode to hours of them.
        rate = int(sound.samplerate)
        seconds = sound.frames / rate if rate else 0.0
        if not MIN_SECONDS <= seconds <= MAX_SECONDS:
            raise BadReference(f"{what} is {seconds:.2f} s long; a reference is {MIN_SECONDS:.0f} to "
                               f"{MAX_SECONDS:.0f} s")
        if sound.frames * sound.channels > MAX_DECODED_SAMPLES:
            raise BadReference(f"{what} has {sound.channels} channels at {rate} Hz: more samples than this server "
                               f"decodes ({MAX_DECODED_SAMPLES}); send it as mono or stereo at up to 96 kHz")
        try:
            samples = sound.read(dtype="float32", always_2d=True)
        except (soundfile.LibsndfileError, RuntimeError, ValueError) as exc:
            raise BadReference(f"{what} could not be decoded: {exc}") from None
    mono = samples.mean(axis=1) if samples.shape[1] > 1 else samples[:, 0]
    if not np.isfinite(mono).all():  # a float file may hold them; the talker's encoders would spread them
        raise BadReference(f"{what} holds samples that are not finite (NaN or Inf)")
    return np.ascontiguousarray(mono, dtype=np.float32), rate
