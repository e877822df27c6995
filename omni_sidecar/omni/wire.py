"""vllm-omni's payload wire format, decoded and encoded with msgspec schemas only.

`additional_information = {"entries": {dotted_key: entry}}`; each entry holds
exactly one of:
  - `tensor_data` (raw row-major bytes) with `tensor_shape` and `tensor_dtype`
    (a dtype name; bfloat16 works here, unlike vllm-omni 0.30's np.dtype path),
  - `list_data`,
  - `scalar_data`.
Tensors in a client's own payload use the same spec: {"data", "shape", "dtype"}.
Every mismatch is a `PayloadError` naming the key.
"""

from __future__ import annotations

from typing import Any

import torch

from omni_sidecar.errors import OmniSidecarError
from omni_sidecar.omni.keys import flatten, unflatten
from omni_sidecar.tensors import tensor_from_bytes, tensor_to_bytes

_KINDS = ("tensor_data", "list_data", "scalar_data")
MAX_ENTRIES = 4096


class PayloadError(OmniSidecarError, ValueError):
    pass


def _dtype_name(name: Any) -> str:
    if not isinstance(name, str):
        raise PayloadError(f"dtype must be a name, got {type(name).__name__}")
    return name.removeprefix("torch.")


def decode_tensor_spec(spec: Any, key: str = "tensor") -> torch.Tensor:
    if not isinstance(spec, dict):
        raise PayloadError(f"{key}: expected {{data, shape, dtype}}, got {type(spec).__name__}")
    try:
        data, shape, dtype = spec["data"], spec["shape"], spec["dtype"]
    except KeyError as exc:
        raise PayloadError(f"{key}: missing {exc.args[0]!r}") from None
    return _decode_tensor(key, data, shape, dtype)


def _decode_tensor(key: str, data: Any, shape: Any, dtype: Any) -> torch.Tensor:
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise PayloadError(f"{key}: tensor data must be bytes")
    if not isinstance(shape, (list, tuple)) or not all(isinstance(d, int) and d >= 0 for d in shape):
        raise PayloadError(f"{key}: tensor shape must be a list of non-negative ints, got {shape!r}")
    try:
        return tensor_from_bytes(bytes(data), list(shape), _dtype_name(dtype))
    except (ValueError, KeyError) as exc:
        raise PayloadError(f"{key}: {exc}") from None


def encode_tensor_spec(tensor: torch.Tensor) -> dict[str, Any]:
    data, shape, dtype = tensor_to_bytes(tensor)
    return {"data": data, "shape": shape, "dtype": dtype}


def decode_additional_information(obj: Any) -> dict[str, Any]:
    """vllm-omni `additional_information` -> nested dict of tensors, lists, scalars."""
    if not isinstance(obj, dict) or not isinstance(obj.get("entries"), dict):
        raise PayloadError("additional_information must be {'entries': {dotted_key: entry}}")
    entries = obj["entries"]
    if len(entries) > MAX_ENTRIES:
        raise PayloadError(f"{len(entries)} entries exceed the cap of {MAX_ENTRIES}")
    flat: dict[str, Any] = {}
    for key, entry in entries.items():
        if not isinstance(entry, dict):
            raise PayloadError(f"{key}: entry must be a dict")
        present = [k for k in _KINDS if entry.get(k) is not None]
        if len(present) != 1:
            raise PayloadError(f"{key}: entry must hold exactly one of {_KINDS}, has {present}")
        kind = present[0]
        if kind == "tensor_data":
            flat[key] = _decode_tensor(key, entry["tensor_data"], entry.get("tensor_shape"), entry.get("tensor_dtype"))
        else:
            flat[key] = entry[kind]
    try:
        return unflatten(flat)
    except ValueError as exc:
        raise PayloadError(str(exc)) from None


def encode_additional_information(nested: dict[str, Any]) -> dict[str, Any]:
    """Nested dict -> vllm-omni's entries format (what a previous stage hands over)."""
    entries: dict[str, Any] = {}
    for key, value in flatten(nested).items():
        if isinstance(value, torch.Tensor):
            data, shape, dtype = tensor_to_bytes(value)
            entries[key] = {"tensor_data": data, "tensor_shape": shape, "tensor_dtype": dtype}
        elif isinstance(value, (list, tuple)):
            entries[key] = {"list_data": list(value)}
        else:
            entries[key] = {"scalar_data": value}
    return {"entries": entries}


def decode_plain_buffer(obj: Any, depth: int = 0) -> Any:
    """A plain `model_intermediate_buffer` dict; tensor specs inside become tensors."""
    if depth > 8:
        raise PayloadError("model_intermediate_buffer nests too deep")
    if isinstance(obj, dict):
        if set(obj) == {"data", "shape", "dtype"}:
            return decode_tensor_spec(obj)
        return {k: decode_plain_buffer(v, depth + 1) for k, v in obj.items()}
    return obj
