"""Code2wav requests for tests: one placeholder prompt token + codes.audio [frames, Q] in vllm-omni's payload."""

from __future__ import annotations

from typing import Any

import torch

from omni_sidecar.hook_sets.omni.code2wav import num_chunks
from omni_sidecar.hook_sets.omni.wire import encode_additional_information
from tests.tiny_models.code2wav import CODE2WAV_CONFIG, PLACEHOLDER_TOKEN


def request_codes(frames: int, seed: int) -> torch.Tensor:
    """Random codec frames [frames, Q] (what a talker's `codes.audio` holds)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, CODE2WAV_CONFIG["codebook_size"], (frames, CODE2WAV_CONFIG["num_quantizers"]),
                         generator=generator)


def code2wav_request(frames: int, seed: int, chunk_frames: int, left_context: int,
                     in_payload: bool = False) -> dict[str, Any]:
    """prompt_token_ids, max_tokens (its chunks) and the encoded payload. `in_payload`: the request
    carries its own chunk size and left context (else the sidecar's options must equal them)."""
    info: dict[str, Any] = {"codes": {"audio": request_codes(frames, seed)}}
    if in_payload:
        info["meta"] = {"codec_chunk_frames": chunk_frames, "codec_left_context_frames": left_context}
    return {"prompt_token_ids": [PLACEHOLDER_TOKEN], "max_tokens": num_chunks(frames, chunk_frames),
            "payload": encode_additional_information(info)}
