"""A request's payload in vllm-omni's `additional_information` format, built by the front end.

`{"entries": {dotted key: entry}}`, each entry one of `tensor_data` (row-major bytes, with
`tensor_shape` and torch's dtype name), `list_data` or `scalar_data` (the shim and sidecar
decode it against that schema). Nested dicts become dotted keys.
"""

from __future__ import annotations

from typing import Any

import numpy as np

TORCH_DTYPE_NAMES = {np.dtype(np.float32): "float32", np.dtype(np.float16): "float16", np.dtype(np.int64): "int64",
                     np.dtype(np.int32): "int32", np.dtype(np.bool_): "bool"}


def _entry(value: Any) -> dict[str, Any]:
    if isinstance(value, np.ndarray):
        array = np.ascontiguousarray(value)
        if array.dtype not in TORCH_DTYPE_NAMES:
            raise TypeError(f"a payload array of dtype {array.dtype}")
        return {"tensor_data": array.tobytes(), "tensor_shape": list(array.shape),
                "tensor_dtype": TORCH_DTYPE_NAMES[array.dtype]}
    if isinstance(value, (list, tuple)):
        return {"list_data": list(value)}
    if isinstance(value, (bool, int, float, str)):
        return {"scalar_data": value}
    raise TypeError(f"a payload value of type {type(value).__name__}")


def additional_information(nested: dict[str, Any]) -> dict[str, Any]:
    """{"codes": {"audio": array}, "meta": {"codec_final": True}} -> {"entries": {"codes.audio": ..., ...}}."""
    entries: dict[str, Any] = {}

    def walk(prefix: str, node: dict[str, Any]) -> None:
        for key, value in node.items():
            name = f"{prefix}.{key}" if prefix else key
            if isinstance(value, dict):
                walk(name, value)
            else:
                entries[name] = _entry(value)

    walk("", nested)
    return {"entries": entries}
