"""Audio bytes for the speech endpoint: 16-bit little-endian mono PCM, raw or in a WAV container;
FLAC, MP3 and Opus (in Ogg) encoded by libsndfile, as vllm-omni encodes them (`soundfile`)."""

from __future__ import annotations

import io
import struct

import numpy as np

STREAMED_FORMATS = ("wav", "pcm")  # a stream is PCM as it is made (a WAV: its header first)
# Each format soundfile writes: (its container, its subtype or None for the container's default).
SOUNDFILE_FORMATS = {"flac": ("FLAC", None), "mp3": ("MP3", None), "opus": ("OGG", "OPUS")}
FORMATS = STREAMED_FORMATS + tuple(SOUNDFILE_FORMATS)
# The sample rates the lossy codecs take (FLAC takes any).
CODEC_RATES = {"mp3": (8000, 11025, 12000, 16000, 22050, 24000, 32000, 44100, 48000),
               "opus": (8000, 12000, 16000, 24000, 48000)}
MEDIA_TYPES = {"wav": "audio/wav", "pcm": "audio/pcm", "flac": "audio/flac", "mp3": "audio/mpeg", "opus": "audio/ogg"}
STREAMED_WAV_SIZE = 0xFFFFFFFF  # a streamed WAV's length is unknown when its header goes out


def pcm16(samples: np.ndarray) -> bytes:
    """float samples in [-1, 1] (clipped) -> int16 little-endian bytes."""
    clipped = np.clip(np.asarray(samples, dtype=np.float32), -1.0, 1.0)
    return (clipped * 32767.0).round().astype("<i2").tobytes()


def wav_header(sample_rate: int, data_bytes: int | None) -> bytes:
    """A 44-byte RIFF/WAVE header for 16-bit mono PCM; `data_bytes` None: streamed, sizes at their maximum."""
    data = STREAMED_WAV_SIZE if data_bytes is None else data_bytes
    riff = STREAMED_WAV_SIZE if data_bytes is None else 36 + data_bytes
    return (b"RIFF" + struct.pack("<I", riff) + b"WAVE" + b"fmt "
            + struct.pack("<IHHIIHH", 16, 1, 1, sample_rate, sample_rate * 2, 2, 16)
            + b"data" + struct.pack("<I", data))


def wav(samples: np.ndarray, sample_rate: int) -> bytes:
    body = pcm16(samples)
    return wav_header(sample_rate, len(body)) + body


def encoding_problem(response_format: str, sample_rate: int) -> str | None:
    """Why this server cannot write `response_format` (one of FORMATS) at its model's `sample_rate`,
    or None when it can."""
    if response_format not in SOUNDFILE_FORMATS:
        return None
    rates = CODEC_RATES.get(response_format)
    if rates is not None and sample_rate not in rates:
        return (f"response_format {response_format!r} is not supported for this model's {sample_rate} Hz audio "
                f"({response_format} takes {', '.join(map(str, rates))} Hz)")
    try:
        import soundfile
    except (ImportError, OSError) as exc:  # OSError: the package without its libsndfile
        return f"response_format {response_format!r} needs the soundfile package on the server ({exc})"
    if not soundfile.check_format(*SOUNDFILE_FORMATS[response_format]):
        return (f"response_format {response_format!r} is not supported: this server's libsndfile "
                f"{soundfile.__libsndfile_version__} cannot write it")
    return None


def encoded(samples: np.ndarray, response_format: str, sample_rate: int) -> bytes:
    """The samples in one of FORMATS (one that `encoding_problem` passed)."""
    if response_format == "wav":
        return wav(samples, sample_rate)
    if response_format == "pcm":
        return pcm16(samples)
    import soundfile

    container, subtype = SOUNDFILE_FORMATS[response_format]
    with io.BytesIO() as out:
        soundfile.write(out, np.clip(np.asarray(samples, dtype=np.float32), -1.0, 1.0), sample_rate,
                        format=container, subtype=subtype)
        return out.getvalue()
