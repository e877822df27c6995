"""A batch layout's packing (the shim's side) and its reading as ints (the sidecar's side).

Why packed: a msgpack list of ints costs a Python int per entry on both ends (the shim's
`tolist()` of vLLM's numpy arrays and its encoding, the sidecar's decoding): most of a
StepBegin's cost at a few hundred requests. Packed, the shim writes numpy's buffer as it is,
msgspec moves one `bytes` per array, and the sidecar makes ints only when a hook reads a field
(`StepLayout`): the pre-forward hooks of a steady decode step usually read none.

Everything here is untrusted input on the sidecar's side: `StepLayout.unpacking` checks every
array's length against the request count before a hook can see it (u32 entries need no sign
check; msgspec already capped each array's size).
"""

from __future__ import annotations

import array
import sys
from typing import Any

from proto.messages import U32_BYTES, BatchLayout

_LITTLE = sys.byteorder == "little"
_U32 = next(code for code in "IL" if array.array(code).itemsize == U32_BYTES)


class LayoutError(ValueError):
    """A layout whose arrays do not fit its request count."""


def pack_u32(values: Any) -> bytes:
    """Little-endian u32 bytes of a numpy array (its buffer, no Python ints) or a sequence of ints."""
    if hasattr(values, "astype"):  # numpy: vLLM's int32 arrays become u32 without a copy per int
        return values.astype("<u4", copy=False).tobytes()
    out = array.array(_U32, values)
    if not _LITTLE:
        out.byteswap()
    return out.tobytes()


def unpack_u32(data: bytes) -> list[int]:
    """The ints of a little-endian u32 array (length already checked: a multiple of 4)."""
    if _LITTLE:
        return memoryview(data).cast(_U32).tolist()
    out = array.array(_U32, data)
    out.byteswap()
    return out.tolist()


def packed_layout(req_ids: list[str] | None, query_start_loc: Any, num_computed_tokens: Any,
                  prefill_lens: Any, input_ids: Any = None) -> BatchLayout:
    """The shim's side: arrays (numpy or int sequences) of one step's batch, packed."""
    return BatchLayout(
        req_ids=req_ids,
        query_start_loc=pack_u32(query_start_loc),
        num_computed_tokens=pack_u32(num_computed_tokens),
        prefill_lens=pack_u32(prefill_lens),
        input_ids=pack_u32(input_ids) if input_ids is not None else None,
    )


class _Unpacked:
    """A BatchLayout array of a StepLayout as ints, unpacked on first read and kept on the layout."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, layout: StepLayout | None, owner: type | None = None) -> list[int] | None:
        if layout is None:
            return self  # type: ignore[return-value]  # the class attribute itself
        packed = getattr(layout._packed, self.name, None)
        value = unpack_u32(packed) if packed is not None else None
        layout.__dict__[self.name] = value
        return value


class StepLayout:
    """A step's batch layout as the sidecar's hooks read it: request ids resolved, each array's ints
    a list. Read off a BatchLayout (`unpacking`: ints on first access), or made of lists (a layout the
    sidecar derives: the rows a replay has not seen, the next decode step's prediction).
    """

    # Each array is unpacked on first read (`unpacking` sets two attributes only: it runs for every
    # StepBegin, and the pre-forward hooks of a steady decode step usually read none).
    query_start_loc = _Unpacked()
    num_computed_tokens = _Unpacked()
    prefill_lens = _Unpacked()
    input_ids = _Unpacked()
    _packed: BatchLayout | None = None

    def __init__(self, req_ids: list[str], query_start_loc: list[int], num_computed_tokens: list[int],
                 prefill_lens: list[int], input_ids: list[int] | None = None) -> None:
        self.req_ids = req_ids
        self.query_start_loc, self.num_computed_tokens, self.prefill_lens = query_start_loc, num_computed_tokens, prefill_lens
        self.input_ids = input_ids

    @classmethod
    def unpacking(cls, req_ids: list[str], packed: BatchLayout) -> StepLayout:
        """`packed` read with `req_ids` (its own, or the previous layout's it omitted): LayoutError
        unless every array fits the request count."""
        size = len(req_ids) * U32_BYTES
        if (len(packed.num_computed_tokens) != size or len(packed.prefill_lens) != size
                or len(packed.query_start_loc) != size + U32_BYTES):
            raise LayoutError(f"layout arrays of {len(packed.query_start_loc)}, "
                              f"{len(packed.num_computed_tokens)}, {len(packed.prefill_lens)} bytes "
                              f"do not fit {len(req_ids)} requests")
        if packed.input_ids is not None and len(packed.input_ids) % U32_BYTES:
            raise LayoutError(f"layout input_ids of {len(packed.input_ids)} bytes: not u32 entries")
        layout = cls.__new__(cls)
        layout.req_ids = req_ids
        layout._packed = packed
        return layout

    def packed(self) -> BatchLayout:
        """The wire's form, request ids included."""
        return packed_layout(self.req_ids, self.query_start_loc, self.num_computed_tokens, self.prefill_lens,
                             self.input_ids)

    def _fields(self) -> tuple:
        return (self.req_ids, self.query_start_loc, self.num_computed_tokens, self.prefill_lens, self.input_ids)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, StepLayout) and self._fields() == other._fields()

    __hash__ = None  # type: ignore[assignment]  # lists inside: not hashable, as a list is not

    def __repr__(self) -> str:
        if self._packed is not None and "query_start_loc" not in vars(self):
            return f"StepLayout({len(self.req_ids)} requests, packed)"
        return "StepLayout({}, {}, {}, {}, {})".format(*self._fields())


__all__ = ["LayoutError", "StepLayout", "pack_u32", "packed_layout", "unpack_u32"]
