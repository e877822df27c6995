"""Dotted keys <-> nested dicts, as vllm-omni's payload entries use them.

`{"hidden_states": {"layer_24": t}}` <-> `{"hidden_states.layer_24": t}`.
"""

from __future__ import annotations

from typing import Any

MAX_DEPTH = 8


def flatten(nested: dict[str, Any], prefix: str = "", depth: int = 0) -> dict[str, Any]:
    if depth > MAX_DEPTH:
        raise ValueError(f"nesting deeper than {MAX_DEPTH} levels")
    flat: dict[str, Any] = {}
    for key, value in nested.items():
        if not isinstance(key, str) or not key or "." in key:
            raise ValueError(f"invalid key {key!r}: keys are non-empty strings without dots")
        path = f"{prefix}.{key}" if prefix else key
        if isinstance(value, dict) and value:
            flat.update(flatten(value, path, depth + 1))
        else:
            flat[path] = value
    return flat


def unflatten(flat: dict[str, Any]) -> dict[str, Any]:
    nested: dict[str, Any] = {}
    for path, value in flat.items():
        parts = path.split(".") if isinstance(path, str) else []
        if not parts or any(not p for p in parts) or len(parts) > MAX_DEPTH + 1:
            raise ValueError(f"invalid dotted key {path!r}")
        node = nested
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ValueError(f"key {path!r} conflicts with a value at {part!r}")
            node = child
        if parts[-1] in node and isinstance(node[parts[-1]], dict):
            raise ValueError(f"key {path!r} conflicts with nested keys below it")
        node[parts[-1]] = value
    return nested
