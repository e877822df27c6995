"""The one error the shim's link to its sidecar raises (worker_shim/wire/channel.py re-exports it)."""

from __future__ import annotations


class SidecarError(RuntimeError):
    pass
