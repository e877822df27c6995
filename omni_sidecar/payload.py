"""Client helpers: attach a sidecar payload to a vLLM request the safe way.

`SamplingParams.extra_args` reaches the worker intact when it holds JSON-like
values and bytes; a torch.Tensor there kills the engine (it cannot be
serialized). So tensors travel as {"data": bytes, "shape": [...], "dtype": name}
under the `omni_sidecar` key, and the sidecar decodes them.
"""

from __future__ import annotations

from typing import Any

import torch

from omni_arena.views import tensor_to_bytes

PAYLOAD_KEY = "omni_sidecar"


def encode_tensor(tensor: torch.Tensor) -> dict[str, Any]:
    data, shape, dtype = tensor_to_bytes(tensor)
    return {"data": data, "shape": shape, "dtype": dtype}


def sidecar_extra_args(prompt_embeds: torch.Tensor | None = None, **values: Any) -> dict[str, Any]:
    """`extra_args` for SamplingParams carrying a payload for the sidecar's hooks."""
    payload: dict[str, Any] = dict(values)
    if prompt_embeds is not None:
        payload["prompt_embeds"] = encode_tensor(prompt_embeds)
    return {PAYLOAD_KEY: payload}
