"""vllm-omni's payload wire format, decoded and encoded with msgspec schemas only.

`additional_information` is vllm-omni's `AdditionalInformationPayload`:
`{"entries": {dotted_key: entry}}` (keys by the rules in omni/keys.py), each
entry holding exactly one of
  - `tensor_data` (raw row-major bytes) with `tensor_shape` and `tensor_dtype`
    (torch's dtype name, as vllm-omni 0.26/0.30 write it; bfloat16 included),
  - `list_data`,
  - `scalar_data`.
It arrives as a dict (through `SamplingParams.extra_args`), as msgpack bytes,
or as any msgspec struct of that shape (vllm-omni's own, in-process). Every
value is untrusted: an entry with unknown fields, none or several of the three
forms, a dtype outside the wire's table, or a byte count that does not match
its shape is a `PayloadError` naming the key. On encoding, lists and scalars
must be plain data (a tensor there would need vLLM's own msgpack hook).
Tensors in a client's own payload use the spec {"data", "shape", "dtype"}.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec
import torch

from omni_sidecar.hook_sets.omni.keys import PayloadError, flatten, unflatten
from omni_arena.views import tensor_from_bytes, tensor_to_bytes
from proto.tensors import MAX_TENSOR_DIMS

__all__ = [
    "PayloadError",
    "decode_additional_information",
    "decode_plain_buffer",
    "decode_tensor_spec",
    "encode_additional_information",
    "encode_tensor_spec",
]

MAX_ENTRIES = 4096
MAX_PLAIN_DEPTH = 8
_INT_RANGE = (-(1 << 63), 1 << 64)  # what msgpack can carry


class PayloadEntry(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """One `AdditionalInformationEntry`; explicit nulls are accepted (vllm-omni writes them)."""

    tensor_data: bytes | None = None
    tensor_shape: Annotated[list[int], msgspec.Meta(max_length=MAX_TENSOR_DIMS)] | None = None
    tensor_dtype: str | None = None
    list_data: list[Any] | None = None
    scalar_data: Any = None


class _Envelope(msgspec.Struct, forbid_unknown_fields=True):
    # Entries stay undecoded here so that each one's error can name its key.
    entries: Annotated[dict[str, Any], msgspec.Meta(max_length=MAX_ENTRIES)]


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
    if not isinstance(shape, (list, tuple)) or not all(type(d) is int and d >= 0 for d in shape):
        raise PayloadError(f"{key}: tensor shape must be a list of non-negative ints, got {shape!r}")
    try:
        return tensor_from_bytes(bytes(data), list(shape), _dtype_name(dtype))
    except (ValueError, KeyError) as exc:
        raise PayloadError(f"{key}: {exc}") from None


def encode_tensor_spec(tensor: torch.Tensor) -> dict[str, Any]:
    data, shape, dtype = tensor_to_bytes(tensor)
    return {"data": data, "shape": shape, "dtype": dtype}


# -- additional_information -------------------------------------------------------------


def _envelope(obj: Any) -> _Envelope:
    try:
        if isinstance(obj, (bytes, bytearray, memoryview)):
            return msgspec.msgpack.decode(obj, type=_Envelope)
        if isinstance(obj, msgspec.Struct):
            obj = msgspec.to_builtins(obj, builtin_types=(bytes, bytearray, memoryview))
        return msgspec.convert(obj, _Envelope)
    except msgspec.MsgspecError as exc:
        raise PayloadError(
            f"additional_information must be {{'entries': {{dotted_key: entry}}}}: {exc}"
        ) from None


def _decode_entry(key: str, raw: Any) -> Any:
    data = raw.get("tensor_data") if isinstance(raw, dict) else None
    if data is not None and not isinstance(data, (bytes, bytearray, memoryview)):
        # msgspec.convert would take a base64 string here; the wire carries bytes only.
        raise PayloadError(f"{key}: tensor data must be bytes, got {type(data).__name__}")
    try:
        entry = msgspec.convert(raw, PayloadEntry)
    except msgspec.ValidationError as exc:
        raise PayloadError(f"{key}: {exc}") from None
    forms = [f for f in ("tensor_data", "list_data", "scalar_data") if getattr(entry, f) is not None]
    if len(forms) != 1:
        raise PayloadError(
            f"{key}: an entry holds exactly one of tensor_data, list_data, scalar_data; has {forms}"
        )
    if forms[0] != "tensor_data":
        if entry.tensor_shape is not None or entry.tensor_dtype is not None:
            raise PayloadError(f"{key}: tensor_shape/tensor_dtype without tensor_data")
        return entry.list_data if forms[0] == "list_data" else entry.scalar_data
    if entry.tensor_shape is None or entry.tensor_dtype is None:
        raise PayloadError(f"{key}: tensor_data needs tensor_shape and tensor_dtype")
    return _decode_tensor(key, entry.tensor_data, entry.tensor_shape, entry.tensor_dtype)


def decode_additional_information(obj: Any) -> dict[str, Any]:
    """vllm-omni `additional_information` -> the nested payload its `deserialize_payload` makes."""
    entries = _envelope(obj).entries
    return unflatten({key: _decode_entry(key, raw) for key, raw in entries.items()})


def _check_plain(key: str, value: Any, depth: int = 0) -> None:
    if depth > MAX_PLAIN_DEPTH:
        raise PayloadError(f"{key}: nests deeper than {MAX_PLAIN_DEPTH} levels")
    if value is None or isinstance(value, (bool, float, str, bytes)):
        return
    if isinstance(value, int):
        if not _INT_RANGE[0] <= value < _INT_RANGE[1]:
            raise PayloadError(f"{key}: int {value} does not fit in 64 bits")
    elif isinstance(value, (list, tuple)):
        for item in value:
            _check_plain(key, item, depth + 1)
    elif isinstance(value, dict):
        for k, item in value.items():
            if not isinstance(k, (str, int)) or isinstance(k, bool):
                raise PayloadError(f"{key}: dict key {k!r} is neither a string nor an int")
            _check_plain(key, item, depth + 1)
    else:
        raise PayloadError(
            f"{key}: a {type(value).__name__} cannot travel inside a list or scalar entry "
            "(only tensors at the top of an entry, plain data inside)"
        )


def _encode_entry(key: str, value: Any) -> PayloadEntry:
    if isinstance(value, torch.Tensor):
        data, shape, dtype = tensor_to_bytes(value)
        return PayloadEntry(tensor_data=data, tensor_shape=shape, tensor_dtype=dtype)
    _check_plain(key, value)
    if isinstance(value, (list, tuple)):
        return PayloadEntry(list_data=list(value))
    return PayloadEntry(scalar_data=value)


def encode_additional_information(nested: dict[str, Any]) -> dict[str, Any]:
    """Nested payload -> vllm-omni's entries, as plain data (dicts, lists, bytes).

    What a stage hands to the next (a thinker to its talker): vllm-omni's
    `deserialize_payload` turns it back into `nested` (None values left out).
    Send it in `extra_args`, or `msgspec.msgpack.encode` it.
    """
    if not isinstance(nested, dict):
        raise PayloadError(f"a payload must be a dict, got {type(nested).__name__}")
    entries = {key: _encode_entry(key, value) for key, value in flatten(nested).items()}
    return {"entries": msgspec.to_builtins(entries, builtin_types=(bytes,))}


def decode_plain_buffer(obj: Any, depth: int = 0) -> Any:
    """A plain `model_intermediate_buffer` dict; tensor specs inside become tensors."""
    if depth > MAX_PLAIN_DEPTH:
        raise PayloadError("model_intermediate_buffer nests too deep")
    if isinstance(obj, dict):
        if set(obj) == {"data", "shape", "dtype"}:
            return decode_tensor_spec(obj)
        return {k: decode_plain_buffer(v, depth + 1) for k, v in obj.items()}
    return obj
