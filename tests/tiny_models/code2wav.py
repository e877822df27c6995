"""A tiny Qwen3-TTS-code2wav-shaped stage for tests and the demo (not shipped).

Codes in, waveform out, no sampling: a request's codec frames [F, Q] (the talker's
`codes.audio`) are decoded chunk by chunk, each chunk with up to `left_context`
previous frames prepended whose samples are then cut off, as vllm-omni's
`Qwen3TTSCode2Wav` does with `meta.left_context_size`.

Written by us in the shape of vllm-omni's stage (none of its code). All of the
waveform maths is `Code2WavDecoder`, a plain torch module: the Q codebook
embeddings of a frame are summed, run through causal convolutions (receptive
field `receptive_frames` frames) and upsampled frame-locally to
`samples_per_frame` samples. A frame's samples depend only on it and the
`receptive_frames - 1` frames before it, so a chunked decode whose left context
covers that many frames equals a decode of the whole sequence.

The vLLM model class (tests/support/code2wav_model.py) wraps the same module; the
tests decode with it directly, with no vLLM. This module imports torch and
transformers only; `register()` imports vLLM.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

ARCH = "OmniTinyCode2Wav"
CODE2WAV_CONFIG = dict(
    # The one-layer Qwen3 that carries vLLM's per-request token stream (one placeholder prompt
    # token, then one sampled token per chunk; the tokens themselves mean nothing).
    vocab_size=8,
    hidden_size=64,
    intermediate_size=64,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=32,  # vLLM's CPU attention needs head_dim >= 32
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    # code2wav fields
    num_quantizers=4,
    codebook_size=64,
    decoder_dim=32,
    decoder_kernel=3,
    decoder_dilations=[1, 2],
    upsample_rates=[4, 6],
    output_sample_rate=300,  # 12.5 frames/s x 24 samples per frame
)
PLACEHOLDER_TOKEN = 1  # the one prompt token of a code2wav request
_STAMP = "omni-tiny-code2wav-v2"


class CausalConv(nn.Conv1d):
    """A Conv1d that sees only the current and earlier frames (left padding)."""

    def __init__(self, channels: int, kernel: int, dilation: int = 1):
        super().__init__(channels, channels, kernel, dilation=dilation)
        self.left_pad = (kernel - 1) * dilation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(nn.functional.pad(x, (self.left_pad, 0)))


class Code2WavDecoder(nn.Module):
    """codes [B, Q, F] (codebook-major, vllm-omni's decoder input) -> waveform [B, F * samples_per_frame]."""

    def __init__(self, config: Any):
        super().__init__()
        dim, kernel = int(config.decoder_dim), int(config.decoder_kernel)
        self.num_quantizers = int(config.num_quantizers)
        self.codebooks = nn.ModuleList(nn.Embedding(int(config.codebook_size), dim)
                                       for _ in range(self.num_quantizers))
        self.pre = CausalConv(dim, kernel)
        self.blocks = nn.ModuleList(CausalConv(dim, kernel, d) for d in config.decoder_dilations)
        rates = [int(r) for r in config.upsample_rates]
        widths = [dim] + [max(dim >> (i + 1), 4) for i in range(len(rates) - 1)] + [1]
        # kernel == stride: each frame's samples come from that frame's features alone.
        self.upsample = nn.ModuleList(nn.ConvTranspose1d(widths[i], widths[i + 1], r, stride=r)
                                      for i, r in enumerate(rates))
        self.samples_per_frame = 1
        for r in rates:
            self.samples_per_frame *= r
        self.receptive_frames = 1 + (kernel - 1) * (1 + sum(int(d) for d in config.decoder_dilations))

    def forward(self, codes: torch.Tensor) -> torch.Tensor:
        x = sum(book(codes[:, q]) for q, book in enumerate(self.codebooks)).transpose(1, 2)  # [B, D, F]
        x = nn.functional.gelu(self.pre(x))
        for block in self.blocks:
            x = x + nn.functional.gelu(block(x))
        for i, up in enumerate(self.upsample):
            x = up(x)
            if i + 1 < len(self.upsample):
                x = nn.functional.gelu(x)
        return torch.tanh(x[:, 0])


@torch.no_grad()
def decode_runtime_info(decoder: Code2WavDecoder, info: Any) -> torch.Tensor | None:
    """The model side of one request's step (vllm-omni's code2wav contract): flat codebook-major
    `codes.audio` [Q * (ctx + n)] and `meta.left_context_size` ctx -> the n new frames' waveform
    (the context's samples cut off); None when the request has no chunk this step."""
    codes = (info.get("codes") or {}).get("audio") if isinstance(info, dict) else None
    if not isinstance(codes, torch.Tensor) or codes.numel() == 0:
        return None
    q = decoder.num_quantizers
    if codes.numel() % q:
        raise ValueError(f"code2wav: {codes.numel()} codes do not split into {q} codebooks")
    context = int(info.get("meta", {}).get("left_context_size", 0))
    device = next(decoder.parameters()).device
    wave = decoder(codes.reshape(1, q, -1).to(device=device, dtype=torch.long))[0]
    return wave[context * decoder.samples_per_frame :].float()


def load_code2wav_config(model_dir: str | Path):
    from transformers import Qwen3Config

    return Qwen3Config.from_pretrained(str(model_dir))


def load_decoder(model_dir: str | Path) -> Code2WavDecoder:
    """The checkpoint's decoder as a plain module (no vLLM): the tests' direct forward."""
    from safetensors.torch import load_file

    decoder = Code2WavDecoder(load_code2wav_config(model_dir))
    weights = load_file(str(Path(model_dir) / "model.safetensors"))
    decoder.load_state_dict({k.removeprefix("decoder."): v for k, v in weights.items() if k.startswith("decoder.")})
    return decoder.eval()


def build_tiny_code2wav(path: str | Path, seed: int = 0) -> Path:
    """Create (once) the checkpoint in `path`: config.json + model.safetensors (random, fixed seed)."""
    path = Path(path)
    stamp = path / "omni_tiny.json"
    if stamp.exists() and json.loads(stamp.read_text()).get("stamp") == _STAMP:
        return path
    from safetensors.torch import save_file
    from transformers import Qwen3Config, Qwen3ForCausalLM

    path.mkdir(parents=True, exist_ok=True)
    config = Qwen3Config(**CODE2WAV_CONFIG, architectures=[ARCH], torch_dtype="float32")
    torch.manual_seed(seed)
    backbone = Qwen3ForCausalLM(config)
    decoder = Code2WavDecoder(config)
    tensors = dict(backbone.state_dict())  # model.*, lm_head.*
    tensors.update({f"decoder.{k}": v for k, v in decoder.state_dict().items()})
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))
    config.save_pretrained(path)
    stamp.write_text(json.dumps({"stamp": _STAMP, "seed": seed}))
    return path


def register() -> None:
    """Registers the code2wav's vLLM class with vLLM's ModelRegistry in this process (before `LLM(...)`)."""
    from vllm import ModelRegistry

    from tests.support.code2wav_model import OmniTinyCode2Wav

    ModelRegistry.register_model(ARCH, OmniTinyCode2Wav)
