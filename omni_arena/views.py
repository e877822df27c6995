"""torch views of arena memory, one implementation for the shim and the sidecar.

The wire's dtype names (proto) are torch's names, so the table derives from them.
An arena is host shared memory (`proto.arena.ShmArena`) or a device buffer
(`omni_arena.cuda_ipc.CudaIpcArena`); either way a ref is bounds-checked first.
"""

from __future__ import annotations

from typing import Any

import torch

from proto.arena import ShmArena
from proto.tensors import DTYPE_ITEMSIZE, TensorRef

TORCH_DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in DTYPE_ITEMSIZE}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def torch_dtype(name: str) -> torch.dtype:
    try:
        return TORCH_DTYPES[name]
    except KeyError:
        raise ValueError(f"unsupported dtype {name!r}") from None


def arena_tensor(arena: Any, ref: TensorRef) -> torch.Tensor:
    """A tensor aliasing the bytes `ref` names (bounds-checked); copy to keep it."""
    if not isinstance(arena, ShmArena):
        return arena.tensor(ref)  # a device arena
    dtype = torch_dtype(ref.dtype)
    mv = arena.view(ref)
    if ref.nbytes == 0:
        return torch.empty(ref.shape, dtype=dtype)
    return torch.frombuffer(mv, dtype=dtype).view(ref.shape)
