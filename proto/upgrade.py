"""Hot-upgrade messages (docs/ARCHITECTURE.md, Hot upgrade); part of proto.messages' union."""

from __future__ import annotations

from typing import Annotated

import msgspec

from proto.capabilities import Name, Text


class Takeover(msgspec.Struct, tag="takeover", frozen=True):
    """A new sidecar asks the running one for its state (sent on the old one's socket)."""

    # The hook set taking over and the state layouts it can import (checked before anything switches).
    hook_set: Name
    accepts_state: Annotated[list[Name], msgspec.Meta(max_length=32)]
    new_endpoint: Text
    sidecar_version: Name


class TakeoverState(msgspec.Struct, tag="takeover_state", frozen=True):
    """The old sidecar's state, for the successor only. `state` is the sidecar's own
    msgpack document (requests, hook state, finished outputs); tensors inside it are bytes."""

    hook_set: Name
    state_version: Name
    token: Name
    state: bytes


class SwitchReady(msgspec.Struct, tag="switch_ready", frozen=True):
    """The shim, at a step boundary: every step up to `last_step` is sent; hand over now."""

    last_step: int
    # The last MirrorUpdate the shim applied (updates after it never reach this session's mirror).
    mirror_seq: Annotated[int, msgspec.Meta(ge=0)] = 0


class SwitchAck(msgspec.Struct, tag="switch_ack", frozen=True):
    endpoint: Text
    token: Name
