"""Nested payload <-> dotted keys, by vllm-omni's rules (docs/ARCHITECTURE.md, "vllm-omni semantics").

The rules (vllm-omni 0.26 and 0.30, `data_entry_keys.flatten_payload`/`unflatten_payload`):
- only the categories `hidden_states`, `embed`, `ids`, `codes`, `meta` are
  expanded, one level: `{"codes": {"audio": t}}` <-> `"codes.audio"`;
- `hidden_states["layers"][N]` (int N) <-> `"hidden_states.layer_N"`;
- every other top-level value is kept whole (a dict stays one entry);
- a dotted key is split once, at its first dot: `"meta.a.b"` -> `meta["a.b"]`,
  `"speaker.x"` -> `{"speaker": {"x": ...}}`.
`None` values are left out, as vllm-omni's serializer does.

What vllm-omni would never produce, or what would not come back as it went in,
is a `PayloadError` naming the key, in both directions: a category that is not
a dict or that arrives undotted, `hidden_states.layers` as one entry, a
`hidden_states.layer_*` qualifier outside `layers` or whose index is not a
plain non-negative decimal int, a non-tensor layer, a top-level key with a dot,
empty or non-string keys, and a key that is both a value and a dict.
"""

from __future__ import annotations

from typing import Any, Literal, get_args

import torch

from omni_sidecar.errors import OmniSidecarError

Category = Literal["hidden_states", "embed", "ids", "codes", "meta"]
CATEGORIES: frozenset[str] = frozenset(get_args(Category))
HIDDEN = "hidden_states"
LAYERS = "layers"
LAYER_PREFIX = "layer_"


class PayloadError(OmniSidecarError, ValueError):
    """A payload that cannot be decoded or encoded; the message names the key."""


def layer_key(index: int) -> str:
    """The dotted key of layer `index`'s hidden states."""
    return f"{HIDDEN}.{LAYER_PREFIX}{_layer_index(index, f'{HIDDEN}.{LAYERS}')}"


def _layer_index(index: Any, where: str) -> int:
    if type(index) is not int or index < 0:
        raise PayloadError(f"{where}: layer index {index!r} is not a non-negative int")
    return index


def _parse_layer(key: str, text: str) -> int:
    # Only what f"layer_{n}" writes: int() would also take "+3", "03", "3_0", " 3".
    if not text.isascii() or not text.isdigit() or (len(text) > 1 and text[0] == "0"):
        raise PayloadError(f"{key}: layer index {text!r} is not a plain non-negative decimal int")
    return int(text)


def _check_layer_value(key: str, value: Any) -> None:
    if not isinstance(value, torch.Tensor):
        raise PayloadError(f"{key}: a layer's hidden states must be a tensor, got {type(value).__name__}")


def _check_name(key: Any, where: str) -> str:
    if not isinstance(key, str) or not key:
        raise PayloadError(f"{where}: key {key!r} is not a non-empty string")
    return key


def flatten(nested: dict[str, Any]) -> dict[str, Any]:
    """`{category: {qualifier: v}, top: v}` -> `{"category.qualifier": v, "top": v}`."""
    flat: dict[str, Any] = {}
    for key, value in nested.items():
        _check_name(key, "payload")
        if value is None:
            continue
        if "." in key:
            raise PayloadError(f"{key}: a top-level key with a dot comes back split in two")
        if key not in CATEGORIES:
            flat[key] = value
            continue
        if not isinstance(value, dict):
            raise PayloadError(f"{key}: a category must be a dict, got {type(value).__name__}")
        for qualifier, item in value.items():
            path = f"{key}.{_check_name(qualifier, key)}"
            if item is None:
                continue
            if key == HIDDEN and qualifier == LAYERS:
                flat.update(_flatten_layers(item))
            elif key == HIDDEN and qualifier.startswith(LAYER_PREFIX):
                raise PayloadError(
                    f"{path}: vllm-omni reads this key as hidden_states['layers'][N]; put the layer there"
                )
            else:
                flat[path] = item
    return flat


def _flatten_layers(layers: Any) -> dict[str, Any]:
    where = f"{HIDDEN}.{LAYERS}"
    if not isinstance(layers, dict):
        raise PayloadError(f"{where}: must be a dict of layer index -> tensor, got {type(layers).__name__}")
    flat = {}
    for index, tensor in layers.items():
        key = layer_key(_layer_index(index, where))
        _check_layer_value(key, tensor)
        flat[key] = tensor
    return flat


def unflatten(flat: dict[str, Any]) -> dict[str, Any]:
    """Dotted keys -> the nested payload vllm-omni's `unflatten_payload` makes of them."""
    nested: dict[str, Any] = {}
    dotted: set[str] = set()  # heads built from dotted keys (their dicts are ours)
    for key, value in flat.items():
        _check_name(key, "payload")
        head, dot, qualifier = key.partition(".")
        if not dot:
            if key in CATEGORIES:
                raise PayloadError(f"{key}: a category comes as dotted keys ({key}.name), not whole")
            if key in nested:
                raise PayloadError(f"{key}: conflicts with the dotted keys under it")
            nested[key] = value
            continue
        if not head or not qualifier:
            raise PayloadError(f"{key}: an empty part before or after the first dot")
        if head in nested and head not in dotted:
            raise PayloadError(f"{key}: conflicts with the value at {head!r}")
        dotted.add(head)
        node = nested.setdefault(head, {})
        if head == HIDDEN and qualifier == LAYERS:
            raise PayloadError(f"{key}: layers come one per key, as {HIDDEN}.{LAYER_PREFIX}N")
        if head == HIDDEN and qualifier.startswith(LAYER_PREFIX):
            _check_layer_value(key, value)
            node.setdefault(LAYERS, {})[_parse_layer(key, qualifier[len(LAYER_PREFIX):])] = value
        else:
            node[qualifier] = value
    return nested
