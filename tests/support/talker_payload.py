"""Talker requests for tests: codec prompt ids + the thinker hand-over payload.

The payload is what a thinker stage hands a Qwen3-TTS-shaped talker in
vllm-omni's format: `hidden_states.output` [T_text, H_thinker] and
`embed.tts_pad` [1, H_thinker] (plus optional `meta.*` scalars). The prompt is
one codec id per prompt row (BOS, then PAD); the rows' content comes from the
payload, so requests with equal prompt lengths have equal prompt ids: run them
with prefix caching off.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from omni_sidecar.hook_sets.omni.wire import encode_additional_information
from tests.tiny_models.talker import CODEC_BOS_ID, CODEC_PAD_ID, TALKER_CONFIG


def talker_request(prompt_len: int, text_len: int, seed: int, max_tokens: int = 16,
                   dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """A request for `reference_codes`: prompt_token_ids, info (decoded payload), max_tokens."""
    generator = torch.Generator().manual_seed(seed)
    width = TALKER_CONFIG["thinker_hidden_size"]
    info = {
        "hidden_states": {"output": torch.randn(text_len, width, generator=generator).to(dtype)},
        "embed": {"tts_pad": torch.randn(1, width, generator=generator).to(dtype)},
    }
    return {"prompt_token_ids": [CODEC_BOS_ID] + [CODEC_PAD_ID] * (prompt_len - 1), "info": info,
            "max_tokens": max_tokens}


def encoded_payload(info: dict[str, Any]) -> dict[str, Any]:
    """`info` as vllm-omni's `additional_information` ({"entries": {dotted key: entry}})."""
    return encode_additional_information(info)


def payload_files(info: dict[str, Any], workdir: Path, name: str) -> dict[str, Any]:
    """`info` as an engine job's payload (tests/support/engine_job.py): tensors saved as .npy files."""

    def save(value: Any, key: str) -> Any:
        if isinstance(value, dict):
            return {k: save(v, f"{key}.{k}") for k, v in value.items()}
        if isinstance(value, torch.Tensor):
            path = Path(workdir) / f"{name}.{key}.npy"
            np.save(path, value.to(torch.float32).numpy(), allow_pickle=False)
            return {"npy": str(path), "dtype": str(value.dtype).removeprefix("torch.")}
        return value

    return {"additional_information": save(info, "payload")}
