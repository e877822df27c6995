"""torch views of shared arenas on the shim side (host shared memory or CUDA IPC)."""

from __future__ import annotations

from typing import Any

import torch

from proto.arena import ShmArena
from proto.tensors import DTYPE_ITEMSIZE, TensorRef

# The wire's dtype names (proto) are torch's names, so the table derives from them.
_DTYPES = {name: getattr(torch, name) for name in DTYPE_ITEMSIZE}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def arena_tensor(arena: Any, ref: TensorRef) -> torch.Tensor:
    """Bounds-checked alias of arena memory; the dtype must be one we know."""
    if not isinstance(arena, ShmArena):
        return arena.tensor(ref)  # a device arena (omni_arena.cuda_ipc.CudaIpcArena)
    dtype = _DTYPES.get(ref.dtype)
    if dtype is None:
        raise ValueError(f"tensor ref has unsupported dtype {ref.dtype!r}")
    mv = arena.view(ref)
    if ref.nbytes == 0:
        return torch.empty(ref.shape, dtype=dtype)
    return torch.frombuffer(mv, dtype=dtype).view(ref.shape)
