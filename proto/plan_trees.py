"""A plan's trees with their tensors as msgpack extension values (protocol 1.8, issue #15).

Up to 1.7 a tensor in a plan's extra kwargs or model states is a marker dict (`{TENSOR_MARKER:
ref}`, `{ROW_MARKER: [k, i]}`) that the shim finds by walking every decoded tree in Python: with
per-request state in the extra kwargs (vllm-omni's `runtime_additional_information`) that walk was
most of the shim's plan read, ~1.5 µs per request every step. From 1.8, for shims that announce it,
`StepPlan.extra_kwargs` and `StepPlan.model_states` travel as msgpack bytes of their own, every
tensor in them an extension value naming a tensor of `StepPlan.stacks`:

- `STACK_ROW` (8 bytes: u32 stack, u32 row, little-endian): row `row` of stack `stack`;
- `STACK_WHOLE` (4 bytes: u32 stack): the whole of stack `stack` (a tensor alone of its kind).

The shim copies the stacks out first, then decodes each tree with an `ext_hook` that returns the
tensor itself (worker_shim/transfer.py): msgspec's decoder puts every tensor in place as it builds
the containers, and no Python walks the tree. Nesting is the sender's rule (omni_arena/tensor_tree.py,
MAX_TREE_DEPTH); the receiver relies on msgspec's own recursion guard and the frame cap.
"""

from __future__ import annotations

import struct
from typing import Any

import msgspec

from proto.errors import ProtoError

STACK_ROW = 1
STACK_WHOLE = 2
ROW_MARK = struct.Struct("<II")  # STACK_ROW's data: stack, row
ROW_MARK_WIRE_BYTES = 2 + ROW_MARK.size  # on the wire a fixext8: type byte, code, data
_WHOLE = struct.Struct("<I")
WHOLE = -1  # a StackMark's row for a tensor that is its stack


class PlanTreeError(ProtoError, ValueError):
    """A tree's extension value that is not a tensor mark of this protocol."""


class StackMark:
    """Where a tensor goes in a tree being encoded; `stack` and `row` are filled once the plan's
    stacks are made (the tree is marked before the tensors are grouped)."""

    __slots__ = ("stack", "row")

    def __init__(self) -> None:
        self.stack = -1
        self.row = WHOLE


def _mark_ext(obj: Any) -> msgspec.msgpack.Ext:
    if type(obj) is not StackMark:
        raise TypeError(f"a plan's tree cannot hold a {type(obj).__name__}")
    if obj.stack < 0:
        raise PlanTreeError("a tensor's mark was never given its stack")
    if obj.row == WHOLE:
        return msgspec.msgpack.Ext(STACK_WHOLE, _WHOLE.pack(obj.stack))
    return msgspec.msgpack.Ext(STACK_ROW, ROW_MARK.pack(obj.stack, obj.row))


_ENCODER = msgspec.msgpack.Encoder(enc_hook=_mark_ext)


def encode_tree(tree: Any) -> bytes:
    """A marked tree (its tensors `StackMark`s) as the bytes a 1.8 plan carries."""
    return _ENCODER.encode(tree)


def read_mark(code: int, data: memoryview) -> tuple[int, int]:
    """(stack, row) of an extension value; row `WHOLE` for a whole stack. PlanTreeError for any
    other extension (untrusted bytes: the code and the length are checked)."""
    if code == STACK_ROW and len(data) == ROW_MARK.size:
        return ROW_MARK.unpack(data)
    if code == STACK_WHOLE and len(data) == _WHOLE.size:
        return _WHOLE.unpack(data)[0], WHOLE
    raise PlanTreeError(f"unknown extension value in a plan's tree (code {code}, {len(data)} bytes)")


def decode_tree(data: bytes, kind: type = dict[str, Any]) -> Any:
    """The tree with each tensor as its (stack, row) pair: for tools and tests that read a plan
    without an arena (the shim decodes with its own hook, straight into tensors)."""
    return msgspec.msgpack.Decoder(kind, ext_hook=read_mark).decode(data)
