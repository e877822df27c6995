"""Voices uploaded for cloning (vllm-omni's `POST /v1/audio/voices`): a name for a reference clip and,
for in-context cloning, its transcript; a Base request that names the voice is spoken in it.

Kept as vllm-omni's speech server keeps them, so a directory either server wrote is served by the other:
one safetensors file a voice, `{name}_{consent}_{created_at}.safetensors`, its clip as the `audio`
tensor (float32) and its details as strings in the file's header. The directory is vllm-omni's
(`$SPEAKER_SAMPLES_DIR`, else ~/.cache/vllm-omni/speakers) unless `--voice-dir` names another; it is
made on the first upload. A voice may be uploaded as its speaker embedding instead (vllm-omni's
`speaker_embedding` upload: the `speaker_embedding` tensor, `embedding_source` "direct").
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import tempfile
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, fields
from pathlib import Path

import numpy as np

from omni_serve.speech.reference import BadReference, decoded

DIR_ENV = "SPEAKER_SAMPLES_DIR"  # vllm-omni's
DEFAULT_DIR = "~/.cache/vllm-omni/speakers"  # vllm-omni's
LIMIT_ENV = "SPEAKER_MAX_UPLOADED"  # vllm-omni's
DEFAULT_LIMIT = 1000  # vllm-omni's
MAX_UPLOAD_BYTES = 10 << 20  # vllm-omni's
# vllm-omni's accepted types; soundfile decides what it can read of them (WAV, FLAC, OGG, MP3).
MIME_TYPES = ("audio/mpeg", "audio/wav", "audio/x-wav", "audio/ogg", "audio/aac", "audio/flac", "audio/webm",
              "audio/mp4")
MIME_BY_SUFFIX = {".wav": "audio/wav", ".mp3": "audio/mpeg", ".mpeg": "audio/mpeg", ".flac": "audio/flac",
                  ".ogg": "audio/ogg", ".aac": "audio/aac", ".webm": "audio/webm", ".mp4": "audio/mp4"}
CLIP_MIME_TYPE = "audio/wav"  # an upload whose type and file name say nothing (vllm-omni's)
EMBEDDING_MIME_TYPE = "application/x-safetensors"  # a voice uploaded as its embedding (vllm-omni's)
CACHED_CLIPS = 16  # clips kept in memory after their first use (mono; 30 s at 24 kHz: ~2.9 MB)
AUDIO = "audio"  # the clip's tensor in a voice's file
TEMPORARY_PREFIX = ".upload-"  # a voice's file while it is written
STALE_TEMPORARY_S = 600.0  # a file still being written after this long was left by a crash
EMBEDDING_VOICE = "direct"  # vllm-omni's embedding_source of a voice stored as its speaker embedding
EMBEDDING = "speaker_embedding"  # that embedding's tensor in the voice's file
MAX_EMBEDDING_SIZE = 4096  # vllm-omni's


def default_dir() -> Path:
    return Path(os.environ.get(DIR_ENV) or DEFAULT_DIR).expanduser()


def default_limit() -> int:
    try:
        return int(os.environ.get(LIMIT_ENV) or DEFAULT_LIMIT)
    except ValueError:
        return DEFAULT_LIMIT


@dataclass(frozen=True)
class UploadedVoice:
    """A voice's details, as vllm-omni writes them into its file's header."""

    name: str
    consent: str
    created_at: int
    file_size: int
    mime_type: str = CLIP_MIME_TYPE
    sample_rate: int = 0
    original_filename: str = ""
    ref_text: str | None = None
    speaker_description: str | None = None
    embedding_source: str = AUDIO
    embedding_dim: int | None = None

    @property
    def key(self) -> str:
        return self.name.lower()  # names match in any case, as vllm-omni matches them

    def header(self) -> dict[str, str]:
        details = {f.name: getattr(self, f.name) for f in fields(self)}
        return {"voice_name_lower": self.key, **{k: str(v) for k, v in details.items() if v is not None}}

    @classmethod
    def from_header(cls, header: dict[str, str]) -> UploadedVoice:
        """A voice from its file's header (the header's numbers as strings); ValueError if it is not one."""

        def number(name: str) -> int | None:
            return int(header[name]) if header.get(name) else None

        name = header.get("name") or header.get("voice_name_lower") or ""
        if not name:
            raise ValueError("no voice name")
        return cls(name=name, consent=header.get("consent", ""), created_at=number("created_at") or 0,
                   file_size=number("file_size") or 0, mime_type=header.get("mime_type") or CLIP_MIME_TYPE,
                   sample_rate=number("sample_rate") or 0, original_filename=header.get("original_filename", ""),
                   ref_text=header.get("ref_text") or None,
                   speaker_description=header.get("speaker_description") or None,
                   embedding_source=header.get("embedding_source") or AUDIO, embedding_dim=number("embedding_dim"))

    def listing(self) -> dict[str, str | int | None]:
        """vllm-omni's `uploaded_voices` entry."""
        entry: dict[str, str | int | None] = {
            "name": self.name, "consent": self.consent, "created_at": self.created_at, "file_size": self.file_size,
            "mime_type": self.mime_type, "embedding_source": self.embedding_source,
            "embedding_dim": self.embedding_dim}
        if self.ref_text:
            entry["ref_text"] = self.ref_text
        if self.speaker_description:
            entry["speaker_description"] = self.speaker_description
        return entry

    def uploaded(self) -> dict[str, str | int]:
        """vllm-omni's answer to an upload (the file's place on the server not given)."""
        if self.embedding_source == EMBEDDING_VOICE:
            return {"name": self.name, "consent": self.consent, "created_at": self.created_at,
                    "embedding_source": self.embedding_source, "embedding_dim": self.embedding_dim or 0}
        answer: dict[str, str | int] = {"name": self.name, "consent": self.consent, "created_at": self.created_at,
                                        "mime_type": self.mime_type, "file_size": self.file_size}
        if self.ref_text:
            answer["ref_text"] = self.ref_text
        if self.speaker_description:
            answer["speaker_description"] = self.speaker_description
        return answer


class BadUpload(ValueError):
    """Why an upload was not kept (a client's fault: a 400), and the form field at fault."""

    def __init__(self, message: str, param: str = "audio_sample") -> None:
        super().__init__(message)
        self.param = param


class UploadedVoices:
    """The voices in a directory: added, removed, and their clips read (thread-safe: uploads are written
    and clips read in worker threads)."""

    def __init__(self, directory: Path, limit: int) -> None:
        self.directory = directory
        self.limit = limit
        self._voices: dict[str, tuple[UploadedVoice, Path]] = {}
        self._clips: OrderedDict[tuple[str, int], tuple[np.ndarray, int]] = OrderedDict()
        self._embeddings: dict[str, np.ndarray] = {}  # those of voices uploaded as one (a few KiB each)
        self._lock = threading.Lock()
        self._last_created = 0

    def restore(self) -> tuple[int, list[str]]:
        """The voices already in the directory (none if it does not exist): (how many, the files skipped
        and why). Two files of one voice (a crash between a replacement's write and the old file's
        removal, or two servers on one directory): the later upload is the voice."""
        from safetensors import safe_open

        if not self.directory.is_dir():
            return 0, []
        self._remove_stale_temporaries()
        skipped = []
        for path in sorted(self.directory.glob("*.safetensors")):
            embedding = None
            try:
                with safe_open(str(path), framework="numpy") as file:
                    voice = UploadedVoice.from_header(dict(file.metadata() or {}))
                    if voice.embedding_source == EMBEDDING_VOICE:  # small: kept in memory
                        embedding = np.asarray(file.get_tensor(EMBEDDING), np.float32).reshape(-1)
            except Exception as exc:  # noqa: BLE001 (anything in a file some other program wrote)
                skipped.append(f"{path.name}: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}")
                continue
            if not voice.file_size:
                voice = dataclasses.replace(voice, file_size=path.stat().st_size)
            kept = self._voices.get(voice.key)
            if kept is not None:
                older, newer = sorted((kept, (voice, path)), key=lambda found: found[0].created_at)
                skipped.append(f"{older[1].name}: an earlier upload of voice {voice.name!r} than {newer[1].name}")
                if newer[1] != path:
                    continue
            self._voices[voice.key] = (voice, path)
            self._embeddings.pop(voice.key, None)
            if embedding is not None:
                self._embeddings[voice.key] = embedding
            self._last_created = max(self._last_created, voice.created_at)
        return len(self._voices), skipped

    def _remove_stale_temporaries(self) -> None:
        for temporary in self.directory.glob(f"{TEMPORARY_PREFIX}*.tmp"):
            with contextlib.suppress(OSError):
                if time.time() - temporary.stat().st_mtime > STALE_TEMPORARY_S:
                    temporary.unlink()

    def get(self, name: str) -> UploadedVoice | None:
        with self._lock:
            found = self._voices.get(name.strip().lower())
        return found[0] if found else None

    def all(self) -> list[UploadedVoice]:
        with self._lock:
            return sorted((voice for voice, _ in self._voices.values()), key=lambda voice: voice.key)

    def add(self, name: str, consent: str, data: bytes, filename: str, mime_type: str | None,
            ref_text: str | None = None, description: str | None = None) -> UploadedVoice:
        """A clip kept under `name` (one of that name already kept is replaced, as vllm-omni replaces it);
        BadUpload says why not."""
        name = checked_name(name)
        mime_type = upload_mime_type(mime_type, filename)
        if len(data) > MAX_UPLOAD_BYTES:
            raise BadUpload(f"audio_sample is {len(data)} bytes; at most {MAX_UPLOAD_BYTES >> 20} MiB")
        try:
            samples, rate = decoded(data, "audio_sample")
        except BadReference as exc:
            raise BadUpload(str(exc)) from None
        voice = UploadedVoice(name=name, consent=consent, created_at=0, file_size=len(data), mime_type=mime_type,
                              sample_rate=rate, original_filename=filename, ref_text=(ref_text or "").strip() or None,
                              speaker_description=(description or "").strip() or None)
        return self._keep(voice, {AUDIO: samples}, clip=(samples, rate))

    def add_embedding(self, name: str, consent: str, embedding: np.ndarray) -> UploadedVoice:
        """A speaker embedding kept under `name` as vllm-omni keeps one (its width checked by the caller)."""
        name = checked_name(name)
        embedding = np.ascontiguousarray(embedding, dtype=np.float32).reshape(-1)
        voice = UploadedVoice(name=name, consent=consent, created_at=0, file_size=0,
                              mime_type=EMBEDDING_MIME_TYPE, embedding_source=EMBEDDING_VOICE,
                              embedding_dim=int(embedding.shape[0]))
        return self._keep(voice, {EMBEDDING: embedding}, embedding=embedding)

    def _keep(self, voice: UploadedVoice, tensors: dict[str, np.ndarray], clip: tuple[np.ndarray, int] | None = None,
              embedding: np.ndarray | None = None) -> UploadedVoice:
        """The voice's file written whole and synced, then renamed into place (a crash leaves the old voice
        or the new one, never half of one), replacing one of its name, its clip or embedding in memory with
        it; the voice with its time of upload. Written outside the lock: requests look voices up meanwhile."""
        from safetensors.numpy import save_file

        with self._lock:
            self._check_room(voice.key)
            self._last_created = max(int(time.time()), self._last_created + 1)
            voice = dataclasses.replace(voice, created_at=self._last_created)
        path = self.directory / f"{_file_part(voice.name)}_{_file_part(voice.consent)}_{voice.created_at}.safetensors"
        self.directory.mkdir(parents=True, exist_ok=True)
        handle, temporary = tempfile.mkstemp(dir=self.directory, prefix=TEMPORARY_PREFIX, suffix=".tmp")
        os.close(handle)
        try:
            save_file(tensors, temporary, metadata=voice.header())
            with open(temporary, "rb") as written:
                os.fsync(written.fileno())
            if not voice.file_size:  # an embedding's: its file's, as vllm-omni gives it (read again on restore)
                voice = dataclasses.replace(voice, file_size=os.path.getsize(temporary))
            os.replace(temporary, path)
        except BaseException:
            Path(temporary).unlink(missing_ok=True)
            raise
        with self._lock:
            old = self._voices.get(voice.key)
            superseded = old is not None and old[0].created_at > voice.created_at  # a later upload of the name
            try:
                self._check_room(voice.key)  # another voice may have taken the last place meanwhile
            except BadUpload:
                path.unlink(missing_ok=True)
                raise
            if not superseded:
                self._forget(voice.key)
                self._voices[voice.key] = (voice, path)
                if clip is not None:
                    self._clips[(voice.key, voice.created_at)] = clip
                    self._trim()
                if embedding is not None:
                    self._embeddings[voice.key] = embedding
        stale = path if superseded else old[1] if old is not None and old[1] != path else None
        if stale is not None:
            stale.unlink(missing_ok=True)
        return voice

    def _check_room(self, key: str) -> None:
        if key not in self._voices and len(self._voices) >= self.limit:
            raise BadUpload(f"{len(self._voices)} voices are uploaded, at or over this server's limit of "
                            f"{self.limit} (${LIMIT_ENV}): delete one first (DELETE /v1/audio/voices/NAME)")

    def remove(self, name: str) -> bool:
        """The voice and its file gone (False: there is none); an OSError leaves it as it was."""
        key = name.strip().lower()
        with self._lock:
            found = self._voices.get(key)
        if found is None:
            return False
        found[1].unlink(missing_ok=True)
        with self._lock:
            if self._voices.get(key) is found:
                del self._voices[key]
                self._forget(key)
        return True

    def clip(self, voice: UploadedVoice) -> tuple[np.ndarray, int]:
        """The voice's clip (mono float32, its rate); BadReference if it cannot be read now."""
        from safetensors.numpy import load_file

        if voice.embedding_source == EMBEDDING_VOICE:
            raise BadReference(f"voice {voice.name!r} was uploaded as a speaker embedding: it has no clip")
        key = (voice.key, voice.created_at)
        with self._lock:
            if key in self._clips:
                self._clips.move_to_end(key)
                return self._clips[key]
            found = self._voices.get(voice.key)
        if found is None or found[0].created_at != voice.created_at:
            raise BadReference(f"voice {voice.name!r} was deleted or replaced while the request was read")
        try:
            samples = load_file(str(found[1]))[AUDIO]
        except Exception as exc:  # noqa: BLE001 (a file on disk: gone, or written by another program)
            raise BadReference(f"voice {voice.name!r}'s file cannot be read: {exc}") from None
        audio = np.ascontiguousarray(samples.mean(axis=1) if samples.ndim == 2 else samples.reshape(-1),
                                     dtype=np.float32)
        with self._lock:
            self._clips[key] = (audio, voice.sample_rate)
            self._trim()
        return audio, voice.sample_rate

    def embedding(self, voice: UploadedVoice) -> np.ndarray:
        """The speaker embedding of a voice uploaded as one; BadReference if it is gone."""
        with self._lock:
            found = self._voices.get(voice.key)
            embedding = self._embeddings.get(voice.key)
        if found is None or found[0].created_at != voice.created_at or embedding is None:
            raise BadReference(f"voice {voice.name!r} was deleted or replaced while the request was read")
        return embedding

    def _forget(self, key: str) -> None:
        """A voice's clips and embedding out of memory (it is replaced or removed)."""
        for cached in [cached for cached in self._clips if cached[0] == key]:
            del self._clips[cached]
        self._embeddings.pop(key, None)

    def _trim(self) -> None:
        while len(self._clips) > CACHED_CLIPS:
            self._clips.popitem(last=False)


def checked_name(name: str) -> str:
    """vllm-omni's rule: not blank, no path separator or NUL, not '.' or '..'."""
    trimmed = (name or "").strip()
    if not trimmed or trimmed in (".", "..") or any(c in trimmed for c in "/\\\x00"):
        raise BadUpload(f"name {name!r} is not a voice name: it must be non-blank, without / \\ or NUL", "name")
    return trimmed


def upload_mime_type(given: str | None, filename: str) -> str:
    """The upload's type: its own, else its file name's (vllm-omni's rule, WAV where neither says)."""
    mime_type = (given or "").split(";")[0].strip().lower()
    if mime_type in ("", "application/octet-stream"):
        mime_type = MIME_BY_SUFFIX.get(Path(filename or "").suffix.lower(), CLIP_MIME_TYPE)
    if mime_type not in MIME_TYPES:
        raise BadUpload(f"audio_sample's type {mime_type!r} is not audio this server takes: {', '.join(MIME_TYPES)}")
    return mime_type


def _file_part(text: str) -> str:
    """A name or consent in a voice's file name: letters, digits and _ . - only (vllm-omni names its files
    so; any name would do, restore reads the header)."""
    return re.sub(r"[^a-zA-Z0-9_.\-]", "_", os.path.basename(text))[:100] or "file"

