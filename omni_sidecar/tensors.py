"""Tensors sent inline as bytes (payloads, outputs).

Views of arena memory and the dtype table live in omni_arena.views (shared with the shim); the
sidecar's arena writes in omni_sidecar/arenas.py.
"""

from __future__ import annotations

from omni_arena.views import tensor_from_bytes, tensor_to_bytes

__all__ = ["tensor_from_bytes", "tensor_to_bytes"]
