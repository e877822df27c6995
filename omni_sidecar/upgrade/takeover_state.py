"""The state a sidecar hands its successor (TakeoverState.state): a tree in the protocol's one form.

The document (each session's export, the hooks' state, the finished outputs) is a tree whose
tensors travel beside it as inline blobs, encoded and decoded as a MirrorUpdate's entries are
(omni_arena/tensor_tree.py); sets become lists, dict keys stay what they are (vllm-omni keys
`hidden_states.layers` by int). Only sidecars of the same deployment exchange it, over the
owner-only socket; it is still decoded with msgspec schemas only, and every tensor is checked.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

from omni_arena.tensor_tree import decode_inline, encode_inline
from proto.messages import TensorBlob


class _Packed(msgspec.Struct, frozen=True, array_like=True):
    tree: bytes
    blobs: Annotated[list[TensorBlob], msgspec.Meta(max_length=1 << 20)]


_DECODER = msgspec.msgpack.Decoder(_Packed)


def pack(state: dict[str, Any]) -> bytes:
    tree, blobs = encode_inline(state)
    return msgspec.msgpack.encode(_Packed(tree, blobs))


def unpack(blob: bytes) -> dict[str, Any]:
    packed = _DECODER.decode(blob)
    return decode_inline(packed.tree, packed.blobs)
