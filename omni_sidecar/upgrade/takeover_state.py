"""The state a sidecar hands its successor (TakeoverState.state): a tree in the protocol's one form.

The document (each session's export, the hooks' state, the finished outputs) is a tree whose
tensors travel beside it as inline blobs, encoded and decoded as a MirrorUpdate's entries are
(omni_arena/tensor_tree.py); sets become lists, dict keys stay what they are (vllm-omni keys
`hidden_states.layers` by int). Only sidecars of the same deployment exchange it, over the
owner-only socket; it is still decoded with msgspec schemas only, and every tensor is checked.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any, NamedTuple

import msgspec

from omni_arena.tensor_tree import decode_inline, encode_inline
from proto.messages import TensorBlob

if TYPE_CHECKING:
    from omni_sidecar.hook_api.hook_set import OmniHooks
    from omni_sidecar.serve.listener import Listener
    from omni_sidecar.serve.peers import PeerTable
    from omni_sidecar.sessions.store import FinishedOutputs


class UpgradeParts(NamedTuple):
    """What a hot upgrade moves, as either side holds it: the hook set (its state), the finished
    outputs, the sessions (the peer table) and the socket (its address)."""

    hooks: OmniHooks
    finished: FinishedOutputs
    peers: PeerTable
    listener: Listener


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
