"""Tensors into the sidecar's host arena, and tensors sent inline as bytes (payloads, outputs).

Views of arena memory and the dtype table live in omni_arena.views (shared with the shim).
"""

from __future__ import annotations

import torch

from omni_arena.views import arena_tensor, dtype_name, torch_dtype
from proto.arena import ShmArena
from proto.tensors import DTYPE_ITEMSIZE, TensorRef

def write_tensor(arena: ShmArena, offset: int, tensor: torch.Tensor, arena_id: int) -> TensorRef:
    """Copy `tensor` into the arena at `offset` and return its ref."""
    name = dtype_name(tensor.dtype)
    nbytes = tensor.numel() * tensor.element_size()
    ref = TensorRef(arena_id, offset, nbytes, list(tensor.shape), name)
    if nbytes:
        arena_tensor(arena, ref).copy_(tensor)
    return ref


def tensor_from_bytes(data: bytes, shape: list[int], dtype: str) -> torch.Tensor:
    """Decode a row-major tensor sent inline (payloads), checking the byte count."""
    tdtype = torch_dtype(dtype)
    n = 1
    for d in shape:
        n *= d
    want = n * DTYPE_ITEMSIZE[dtype]
    if len(data) != want:
        raise ValueError(f"{len(data)} bytes for shape {list(shape)} of {dtype}; need {want}")
    if want == 0:
        return torch.empty(shape, dtype=tdtype)
    return torch.frombuffer(bytearray(data), dtype=tdtype).view(shape)


def tensor_to_bytes(tensor: torch.Tensor) -> tuple[bytes, list[int], str]:
    """Row-major bytes of any tensor (bf16, bool, 0-d, empty, non-contiguous)."""
    t = tensor.detach().cpu().contiguous()
    if t.numel() == 0:
        return b"", list(t.shape), dtype_name(t.dtype)
    raw = t.reshape(-1).view(torch.uint8)  # a byte view works for every dtype, numpy or not
    return raw.numpy().tobytes(), list(t.shape), dtype_name(t.dtype)
