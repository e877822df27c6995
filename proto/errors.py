"""The one base of every error the wire layer raises (frames, rings, arenas, tensor refs)."""

from __future__ import annotations


class ProtoError(Exception):
    """Something a peer sent (or a shared area holds) that the protocol does not allow."""
