"""Trees with tensors: msgpack bytes whose tensors are extension values naming a list beside them.

A plan's extra kwargs and model states (StepPlan.stacks), a step's model updates and outputs
(StepEnd.tensors) and a mirrored append (MirrorUpdate.blobs) are each a msgpack tree of JSON-like
values; every tensor in it is an extension value naming a tensor of the message's list:

- `STACK_ROW` (8 bytes: u32 stack, u32 row, little-endian): row `row` of stack `stack`;
- `STACK_WHOLE` (4 bytes: u32 stack): the whole of stack `stack` (a tensor alone of its kind).

Same-shaped tensors go as one stack: with per-request state in a tree (vllm-omni's
`runtime_additional_information`) a tree holds the same tensors for every request, and one stack
is one store, one ref and one check for all of them. The sender marks each tensor as msgspec's
encoder meets it, and the receiver decodes with an `ext_hook` that returns the tensor itself
(omni_arena/tensor_tree.py, TreeEncoder / TreeDecoder): no Python walks a tree on either side.
Nesting is bounded by msgspec's own recursion guard and by the frame cap. This module holds the
marks (no torch): the shapes on the wire and their checks.
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
WHOLE = -1  # `read_mark`'s row for a tensor that is its stack


def row_mark(stack: int, row: int) -> msgspec.msgpack.Ext:
    """Row `row` of stack `stack`, as the tree carries it (`read_mark` reads it back)."""
    return msgspec.msgpack.Ext(STACK_ROW, ROW_MARK.pack(stack, row))


def whole_mark(stack: int) -> msgspec.msgpack.Ext:
    """The whole of stack `stack`."""
    return msgspec.msgpack.Ext(STACK_WHOLE, _WHOLE.pack(stack))


class TreeError(ProtoError, ValueError):
    """A received tree that cannot be read: not msgpack, an extension value that is no tensor mark,
    a mark naming a stack or row its message lacks."""


def _refuse(obj: Any) -> Any:
    raise TypeError(f"a tree cannot hold a {type(obj).__name__}")


_ENCODER = msgspec.msgpack.Encoder(enc_hook=_refuse)


def encode_tree(tree: Any) -> bytes:
    """A tree without tensors as the bytes a message carries (one with tensors goes through
    omni_arena/tensor_tree.py's TreeEncoder, which marks each as the encoder meets it)."""
    return _ENCODER.encode(tree)


def read_mark(code: int, data: memoryview) -> tuple[int, int]:
    """(stack, row) of an extension value; row `WHOLE` for a whole stack. TreeError for any other
    extension (untrusted bytes: the code and the length are checked)."""
    if code == STACK_ROW and len(data) == ROW_MARK.size:
        return ROW_MARK.unpack(data)
    if code == STACK_WHOLE and len(data) == _WHOLE.size:
        return _WHOLE.unpack(data)[0], WHOLE
    raise TreeError(f"unknown extension value in a tree (code {code}, {len(data)} bytes)")


def decode_tree(data: bytes, kind: type = dict[str, Any]) -> Any:
    """The tree with each tensor as its (stack, row) pair: for tools and tests that read a tree
    without its tensors (b"" is the empty dict every tree on the wire is at its root)."""
    if not data:
        return {}
    return msgspec.msgpack.Decoder(kind, ext_hook=read_mark).decode(data)
