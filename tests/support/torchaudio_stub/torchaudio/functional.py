"""The one name vllm-omni's utils/audio.py imports; see __init__.py.

`melscale_fbanks` in the one form vllm-omni asks for (Slaney's mel scale and area normalization, as
librosa's default filters): its speaker encoder's mel spectrogram of a voice-cloning request's reference
audio. The textbook triangular filters, written from the formulas, not torchaudio's code."""

from __future__ import annotations

import math

import torch

_F_SP = 200.0 / 3  # Slaney: linear below 1 kHz (3 bands per 200 Hz), logarithmic above
_MIN_LOG_HZ = 1000.0
_MIN_LOG_MEL = _MIN_LOG_HZ / _F_SP
_LOG_STEP = math.log(6.4) / 27.0


def _hz_to_mel(hz: float) -> float:
    return hz / _F_SP if hz < _MIN_LOG_HZ else _MIN_LOG_MEL + math.log(hz / _MIN_LOG_HZ) / _LOG_STEP


def _mel_to_hz(mels: torch.Tensor) -> torch.Tensor:
    return torch.where(mels < _MIN_LOG_MEL, mels * _F_SP, _MIN_LOG_HZ * torch.exp(_LOG_STEP * (mels - _MIN_LOG_MEL)))


def melscale_fbanks(n_freqs: int, f_min: float, f_max: float, n_mels: int, sample_rate: int,
                    norm: str | None = None, mel_scale: str = "htk") -> torch.Tensor:
    """[n_freqs, n_mels] triangular filters, evenly spaced on the mel scale between f_min and f_max."""
    if mel_scale != "slaney" or norm != "slaney":
        raise NotImplementedError("the torchaudio stand-in has Slaney's mel filters only (tests/support/torchaudio_stub)")
    freqs = torch.linspace(0, sample_rate // 2, n_freqs, dtype=torch.float64)
    edges = _mel_to_hz(torch.linspace(_hz_to_mel(f_min), _hz_to_mel(f_max), n_mels + 2, dtype=torch.float64))
    widths = edges[1:] - edges[:-1]
    offsets = edges[None, :] - freqs[:, None]  # [n_freqs, n_mels + 2]
    rising = -offsets[:, :-2] / widths[:-1]
    falling = offsets[:, 2:] / widths[1:]
    filters = torch.clamp(torch.minimum(rising, falling), min=0.0)
    filters *= (2.0 / (edges[2:] - edges[:-2]))[None, :]  # each filter's area the same
    return filters.to(torch.float32)
