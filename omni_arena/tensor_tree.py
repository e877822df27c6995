"""Nested JSON-like values with tensors inside, in both directions across an arena.

A tensor travels as `{TENSOR_MARKER: TensorRef}`; dicts (any key type: vllm-omni keys
`hidden_states.layers` by int), lists and tuples nest up to `MAX_TREE_DEPTH` levels.
Both sides use these two walkers (extra kwargs, model states, model updates and
outputs), so the encoding is written once. A received tree is untrusted: its refs
are converted by the caller's `load`, which bounds-checks them against its arena.
"""

from __future__ import annotations

from typing import Any, Callable

import msgspec
import torch

from omni_arena.views import tensor_from_bytes, tensor_to_bytes
from proto.messages import TensorBlob
from proto.tensors import TENSOR_MARKER, TensorRef

MAX_TREE_DEPTH = 8


class TreeError(ValueError):
    """A tree nests too deep or holds a malformed tensor marker."""


_SCALARS = frozenset({int, float, str, bool, bytes, type(None)})


def store_tree(value: Any, put: Callable[[torch.Tensor], TensorRef], depth: int = 0) -> Any:
    """Tensors become markers holding the ref `put` returns (the tensor copied into an arena)."""
    if type(value) in _SCALARS:  # most leaves (per-request state every step): skip the checks below
        return value
    if depth > MAX_TREE_DEPTH:
        raise TreeError(f"value nests deeper than {MAX_TREE_DEPTH} levels")
    if isinstance(value, torch.Tensor):
        return {TENSOR_MARKER: put(value)}
    # Scalar leaves are kept here, without a call each (per-request state, every step).
    if isinstance(value, dict):
        return {k: v if type(v) in _SCALARS else store_tree(v, put, depth + 1) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [v if type(v) in _SCALARS else store_tree(v, put, depth + 1) for v in value]
    return value


def load_tree(value: Any, load: Callable[[Any], torch.Tensor], ref_type: type = TensorRef) -> Any:
    """Markers become the tensors `load` makes of their refs (a copy out of the arena; `ref_type`
    TensorBlob: a tensor sent inline, see `inline_tree`). The whole tree is checked before the
    first `load`."""
    root, places = index_tree(value, ref_type)
    for holder, key, ref in places:
        holder[key] = load(ref)
    return root[0]


Place = tuple[Any, Any, Any]  # (the dict or list holding a tensor, its key or index, its ref)


def index_tree(value: Any, ref_type: type = TensorRef) -> tuple[list[Any], list[Place]]:
    """A received tree with its tensor markers left as None, and where each tensor goes, in tree
    order: a caller that checks every ref before it makes any tensor (one copy for all of them)
    then puts each in place, without a second walk. The tree comes back as the one item of a list
    (a tree that is itself a tensor has a holder too). TreeError when it nests deeper than
    `MAX_TREE_DEPTH` or holds a malformed marker."""
    places: list[Place] = []
    root = _index([value], places, -1, ref_type)
    return root, places


def _index(value: Any, places: list[Place], depth: int, ref_type: type) -> Any:
    if isinstance(value, dict):
        out: dict = {}
        items = value.items()
    elif isinstance(value, list):
        out = [None] * len(value)  # type: ignore[assignment]
        items = enumerate(value)
    else:
        return value
    if value and depth + 1 > MAX_TREE_DEPTH:
        raise TreeError(f"value nests deeper than {MAX_TREE_DEPTH} levels")
    for key, v in items:
        if type(v) in _SCALARS:
            out[key] = v
        elif type(v) is dict and TENSOR_MARKER in v:
            out[key] = None
            try:
                places.append((out, key, msgspec.convert(v[TENSOR_MARKER], ref_type)))
            except msgspec.ValidationError as exc:
                raise TreeError(f"malformed tensor ref: {exc}") from None
        else:
            out[key] = _index(v, places, depth + 1, ref_type)
    return out


def inline_tree(value: Any) -> Any:
    """Tensors as `{TENSOR_MARKER: TensorBlob}`: bytes in the message itself (MirrorUpdate)."""
    def blob(tensor: torch.Tensor) -> Any:
        data, shape, dtype = tensor_to_bytes(tensor)
        return TensorBlob(shape, dtype, data)

    return store_tree(value, blob)


def load_inline_tree(value: Any) -> Any:
    """`inline_tree`'s inverse for an untrusted message: TreeError on a malformed tensor."""
    def tensor(blob: TensorBlob) -> torch.Tensor:
        try:
            return tensor_from_bytes(blob.data, list(blob.shape), blob.dtype)
        except (KeyError, ValueError, RuntimeError) as exc:
            raise TreeError(f"bad inline tensor: {exc}") from None

    return load_tree(value, tensor, ref_type=TensorBlob)
