"""State handed from a sidecar to its successor: nested JSON-like values and tensors, as msgpack.

Tensors become {"__tensor__": [shape, dtype, bytes]}; sets become lists. Only
sidecars of the same deployment exchange this, over the owner-only socket; it
is still decoded with msgspec schemas only, and tensor byte counts are checked.
"""

from __future__ import annotations

from typing import Any

import msgspec
import torch

from omni_sidecar.tensors import tensor_from_bytes, tensor_to_bytes

_TENSOR = "__tensor__"


def _to_wire(value: Any, depth: int = 0) -> Any:
    if depth > 32:
        raise ValueError("state nests deeper than 32 levels")
    if isinstance(value, torch.Tensor):
        data, shape, dtype = tensor_to_bytes(value)
        return {_TENSOR: [shape, dtype, data]}
    if isinstance(value, dict):
        # int keys stay ints (vllm-omni's hidden_states.layers); msgpack keeps them
        return {k if isinstance(k, (str, int)) else str(k): _to_wire(v, depth + 1) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [_to_wire(v, depth + 1) for v in value]
    return value


def _from_wire(value: Any) -> Any:
    if isinstance(value, dict):
        if _TENSOR in value and len(value) == 1:
            shape, dtype, data = value[_TENSOR]
            return tensor_from_bytes(data, list(shape), dtype)
        return {k: _from_wire(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_from_wire(v) for v in value]
    return value


def pack(state: dict[str, Any]) -> bytes:
    return msgspec.msgpack.encode(_to_wire(state))


def unpack(blob: bytes) -> dict[str, Any]:
    value = _from_wire(msgspec.msgpack.decode(blob))
    if not isinstance(value, dict):
        raise ValueError("handed-over state is not a document")
    return value
