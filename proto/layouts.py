"""A step's batch layout as packed int32 arrays (protocol 1.6, `StepEnd.packed`), both ways.

Why: hooks that read every step's layout get a StepEnd each step, and its three integer columns
(query_start_loc, num_computed_tokens, prefill_lens) as msgpack lists cost the shim a `tolist()`
per column and an encode per element, and the sidecar a decode and a bounds check per element.
Packed, the shim copies vLLM's numpy bytes as they are and the sidecar turns them back into lists
with `array.frombytes` + `tolist()`, both in C. StepBegin keeps its BatchLayout lists.

Wire form: little-endian int32, 4 bytes a row, no header. Every packed layout comes from a peer
and is untrusted: `unpack_layout` checks each column's byte length, that the columns agree on the
row count, and that every count is non-negative (what BatchLayout's `Count` lists guarantee);
anything else is a `LayoutError` (a ValueError: the step message is refused, the peer goes on).
No numpy here (proto imports msgspec and the standard library only): `pack_i32` packs plain ints;
the shim packs numpy arrays with `pack_array`.
"""

from __future__ import annotations

import sys
from array import array
from typing import Any, Iterable

from proto.errors import ProtoError
from proto.messages import MAX_BATCH, MAX_STEP_TOKENS, BatchLayout, PackedLayout

_I32 = "i"  # a C int: 4 bytes on every platform CPython runs on (checked below)
_SWAP = sys.byteorder != "little"  # the wire is little-endian
if array(_I32).itemsize != 4:  # pragma: no cover - no such platform in use
    raise ImportError("array('i') is not 4 bytes here: packed layouts need a 4-byte int")


class LayoutError(ProtoError, ValueError):
    """A packed layout a correct peer never sends (bad length, inconsistent rows, negative counts)."""


def pack_i32(values: Iterable[int]) -> bytes:
    """Plain ints as the wire's int32 (OverflowError for one that does not fit)."""
    packed = array(_I32, values)
    if _SWAP:  # pragma: no cover - big-endian hosts
        packed.byteswap()
    return packed.tobytes()


def pack_array(values: Any) -> bytes:
    """A numpy integer array (vLLM's int32 columns) as the wire's int32: its own bytes when they
    already are little-endian int32 (no copy of values, no Python int per row)."""
    dtype = values.dtype
    if dtype.kind != "i" or dtype.itemsize != 4 or dtype.byteorder == ">" or (dtype.byteorder == "=" and _SWAP):
        values = values.astype("<i4")
    return values.tobytes()


def unpack_i32(buf: bytes, what: str, max_rows: int) -> array:
    """One packed column, checked for its length only (the caller checks values)."""
    if len(buf) % 4:
        raise LayoutError(f"packed {what} of {len(buf)} bytes is not a whole number of int32 rows")
    if len(buf) > 4 * max_rows:
        raise LayoutError(f"packed {what} has {len(buf) // 4} rows, more than {max_rows}")
    column = array(_I32)
    column.frombytes(buf)
    if _SWAP:  # pragma: no cover - big-endian hosts
        column.byteswap()
    return column


def pack_layout(req_ids: list[str] | None, query_start_loc: Any, num_computed_tokens: Any, prefill_lens: Any,
                input_ids: Any = None) -> PackedLayout:
    """The shim's side: numpy columns (already cut to the batch's rows) packed as they are."""
    return PackedLayout(req_ids, pack_array(query_start_loc), pack_array(num_computed_tokens),
                        pack_array(prefill_lens), pack_array(input_ids) if input_ids is not None else None)


def unpack_layout(packed: PackedLayout) -> BatchLayout:
    """The sidecar's side: the BatchLayout hooks read (lists), every column checked."""
    qsl = unpack_i32(packed.query_start_loc, "query_start_loc", MAX_BATCH + 1)
    computed = unpack_i32(packed.num_computed_tokens, "num_computed_tokens", MAX_BATCH)
    prefill = unpack_i32(packed.prefill_lens, "prefill_lens", MAX_BATCH)
    n = len(computed)
    if len(qsl) != n + 1 or len(prefill) != n:
        raise LayoutError(f"packed layout columns disagree on the rows: {len(qsl)} query starts, "
                          f"{n} computed counts, {len(prefill)} prefill lengths")
    if packed.req_ids is not None and len(packed.req_ids) != n:
        raise LayoutError(f"packed layout names {len(packed.req_ids)} requests for {n} rows")
    # min() walks the column in C: the `Count` (>= 0) bound the list form checks per element.
    if min(qsl) < 0 or (n and (min(computed) < 0 or min(prefill) < 0)):
        raise LayoutError("packed layout holds a negative count")
    if qsl[n] > MAX_STEP_TOKENS:
        raise LayoutError(f"packed layout's last query start {qsl[n]} exceeds {MAX_STEP_TOKENS} tokens")
    ids = None
    if packed.input_ids is not None:
        ids = unpack_i32(packed.input_ids, "input_ids", MAX_STEP_TOKENS).tolist()
    return BatchLayout(packed.req_ids, qsl.tolist(), computed.tolist(), prefill.tolist(), ids)


__all__ = ["LayoutError", "pack_array", "pack_i32", "pack_layout", "unpack_i32", "unpack_layout"]
