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
tensor itself (worker_shim/plan_read.py): msgspec's decoder puts every tensor in place as it builds
the containers, and no Python walks the tree. The sender marks each tensor as its encoder meets it,
no walk either (omni_arena/tensor_tree.py, ExtStacker). Nesting is bounded by msgspec's own recursion
guard on both sides and by the frame cap (MAX_TREE_DEPTH is the marker trees' rule: a Python walk).
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


class PlanTreeError(ProtoError, ValueError):
    """A tree's extension value that is not a tensor mark of this protocol."""


def _refuse(obj: Any) -> Any:
    raise TypeError(f"a plan's tree cannot hold a {type(obj).__name__}")


_ENCODER = msgspec.msgpack.Encoder(enc_hook=_refuse)


def encode_tree(tree: Any) -> bytes:
    """A tree without tensors as the bytes a 1.8 plan carries (the sidecar's stacker encodes one
    with tensors, marking each as the encoder meets it: omni_arena/tensor_tree.py, ExtStacker)."""
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
