"""Tensors into the sidecar's host arena, and tensors sent inline as bytes (payloads, outputs).

Views of arena memory and the dtype table live in omni_arena.views (shared with the shim).
"""

from __future__ import annotations

import torch

from omni_arena.views import arena_tensor, dtype_name, tensor_from_bytes, tensor_to_bytes
from proto.arena import ShmArena
from proto.tensors import TensorRef

__all__ = ["tensor_from_bytes", "tensor_to_bytes", "write_tensor"]

def write_tensor(arena: ShmArena, offset: int, tensor: torch.Tensor, arena_id: int) -> TensorRef:
    """Copy `tensor` into the arena at `offset` and return its ref."""
    name = dtype_name(tensor.dtype)
    nbytes = tensor.numel() * tensor.element_size()
    ref = TensorRef(arena_id, offset, nbytes, list(tensor.shape), name)
    if nbytes:
        arena_tensor(arena, ref).copy_(tensor)
    return ref
