"""Audio bytes for the speech endpoint: 16-bit little-endian mono PCM, raw or in a WAV container."""

from __future__ import annotations

import struct

import numpy as np

FORMATS = ("wav", "pcm")
MEDIA_TYPES = {"wav": "audio/wav", "pcm": "audio/pcm"}
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


def encoded(samples: np.ndarray, response_format: str, sample_rate: int) -> bytes:
    """The samples in one of FORMATS."""
    return wav(samples, sample_rate) if response_format == "wav" else pcm16(samples)
