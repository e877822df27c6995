"""Packed batch layouts (protocol 1.6): the per-request ints of a StepBegin as u32 arrays.

Why: a msgpack list of ints costs a Python int per entry on both ends (the shim's
`tolist()` of vLLM's numpy arrays and its encoding, the sidecar's decoding): most of
a StepBegin's cost at a few hundred requests. Packed, the shim writes numpy's buffer
as it is, msgspec moves one `bytes` per array, and the sidecar makes ints only when a
hook reads a field (`LazyLayout`): the pre-forward hooks of a steady decode step
usually read none.

Everything here is untrusted input on the sidecar's side: `LazyLayout` checks every
array's length against the request count before a hook can see it (u32 entries
need no sign check; msgspec already capped each array's size).
"""

from __future__ import annotations

import array
import sys
from typing import Any

from proto.messages import U32_BYTES, BatchLayout, PackedLayout

_LITTLE = sys.byteorder == "little"
_U32 = next(code for code in "IL" if array.array(code).itemsize == U32_BYTES)


class LayoutError(ValueError):
    """A packed layout whose arrays do not fit its request count."""


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
                  prefill_lens: Any, input_ids: Any = None) -> PackedLayout:
    """The shim's side: arrays (numpy or int sequences) of one step's batch, packed."""
    return PackedLayout(
        req_ids=req_ids,
        query_start_loc=pack_u32(query_start_loc),
        num_computed_tokens=pack_u32(num_computed_tokens),
        prefill_lens=pack_u32(prefill_lens),
        input_ids=pack_u32(input_ids) if input_ids is not None else None,
    )


class LazyLayout:
    """A PackedLayout read as a BatchLayout (same attribute names): ints on first access.

    `req_ids` is the resolved list (the packed message omits it when unchanged). Hooks
    type their argument `BatchLayout`; `materialize()` gives a real one where a
    msgspec struct is needed.
    """

    # Unpacked arrays, set on first access (class defaults: construction sets two attributes only;
    # it runs for every StepBegin).
    _qsl: list[int] | None = None
    _computed: list[int] | None = None
    _prefill: list[int] | None = None
    _input_ids: list[int] | None = None

    def __init__(self, req_ids: list[str], packed: PackedLayout) -> None:
        size = len(req_ids) * U32_BYTES
        if (len(packed.num_computed_tokens) != size or len(packed.prefill_lens) != size
                or len(packed.query_start_loc) != size + U32_BYTES):
            raise LayoutError(f"packed layout arrays of {len(packed.query_start_loc)}, "
                              f"{len(packed.num_computed_tokens)}, {len(packed.prefill_lens)} bytes "
                              f"do not fit {len(req_ids)} requests")
        if packed.input_ids is not None and len(packed.input_ids) % U32_BYTES:
            raise LayoutError(f"packed input_ids of {len(packed.input_ids)} bytes: not u32 entries")
        self.req_ids = req_ids
        self._packed = packed

    @property
    def query_start_loc(self) -> list[int]:
        if self._qsl is None:
            self._qsl = unpack_u32(self._packed.query_start_loc)
        return self._qsl

    @property
    def num_computed_tokens(self) -> list[int]:
        if self._computed is None:
            self._computed = unpack_u32(self._packed.num_computed_tokens)
        return self._computed

    @property
    def prefill_lens(self) -> list[int]:
        if self._prefill is None:
            self._prefill = unpack_u32(self._packed.prefill_lens)
        return self._prefill

    @property
    def input_ids(self) -> list[int] | None:
        if self._input_ids is None and self._packed.input_ids is not None:
            self._input_ids = unpack_u32(self._packed.input_ids)
        return self._input_ids

    def materialize(self) -> BatchLayout:
        return BatchLayout(self.req_ids, self.query_start_loc, self.num_computed_tokens, self.prefill_lens,
                           self.input_ids)

    def __repr__(self) -> str:
        return f"LazyLayout({len(self.req_ids)} requests)"


def unpacked(layout: BatchLayout | LazyLayout) -> BatchLayout:
    """A BatchLayout either way (for code that builds or encodes msgspec structs from it)."""
    return layout.materialize() if isinstance(layout, LazyLayout) else layout


__all__ = ["LayoutError", "LazyLayout", "pack_u32", "packed_layout", "unpack_u32", "unpacked"]
