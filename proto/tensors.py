"""Tensor references: where a tensor lies in an arena, never the bytes.

A ref is untrusted input: the receiver checks it against the arena it names
(`check_ref`) before touching memory, so a hostile or buggy peer can at worst
get an error back.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from proto.errors import ProtoError

# dtype name -> item size. Names follow torch (`str(dtype)` minus "torch.").
DTYPE_ITEMSIZE: dict[str, int] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float64": 8,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
}

MAX_TENSOR_DIMS = 8
Dim = Annotated[int, msgspec.Meta(ge=0, le=1 << 40)]


class TensorRef(msgspec.Struct, frozen=True, array_like=True):
    """A tensor stored in a shared arena of the peer: (arena, offset, shape, dtype)."""

    arena: Annotated[int, msgspec.Meta(ge=0, le=255)]
    offset: Annotated[int, msgspec.Meta(ge=0)]
    nbytes: Annotated[int, msgspec.Meta(ge=0)]
    shape: Annotated[list[Dim], msgspec.Meta(max_length=MAX_TENSOR_DIMS)]
    dtype: str


class TensorRefError(ProtoError, ValueError):
    """A tensor ref that does not fit its arena or its own shape and dtype."""


def numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def expected_nbytes(shape: list[int], dtype: str) -> int:
    try:
        itemsize = DTYPE_ITEMSIZE[dtype]
    except KeyError:
        raise TensorRefError(
            f"unknown dtype {dtype!r}; supported: {', '.join(sorted(DTYPE_ITEMSIZE))}"
        ) from None
    return numel(shape) * itemsize


def check_ref(ref: TensorRef, arena_size: int) -> None:
    """Raise TensorRefError unless `ref` describes bytes inside an arena of `arena_size`."""
    want = expected_nbytes(ref.shape, ref.dtype)
    if want != ref.nbytes:
        raise TensorRefError(
            f"tensor ref says {ref.nbytes} bytes but shape {ref.shape} of {ref.dtype} "
            f"needs {want}"
        )
    if ref.offset + ref.nbytes > arena_size:
        raise TensorRefError(
            f"tensor ref [{ref.offset}, {ref.offset + ref.nbytes}) lies outside "
            f"arena {ref.arena} of {arena_size} bytes"
        )
