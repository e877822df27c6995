"""torch views of shared arenas on the shim side (CPU shared memory for now)."""

from __future__ import annotations

import torch

from proto.arena import ShmArena
from proto.tensors import TensorRef

_DTYPES = {
    "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
    "float64": torch.float64, "int64": torch.int64, "int32": torch.int32,
    "int16": torch.int16, "int8": torch.int8, "uint8": torch.uint8, "bool": torch.bool,
}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def arena_tensor(arena: ShmArena, ref: TensorRef) -> torch.Tensor:
    """Bounds-checked alias of arena memory; the dtype must be one we know."""
    dtype = _DTYPES.get(ref.dtype)
    if dtype is None:
        raise ValueError(f"tensor ref has unsupported dtype {ref.dtype!r}")
    mv = arena.view(ref)
    if ref.nbytes == 0:
        return torch.empty(ref.shape, dtype=dtype)
    return torch.frombuffer(mv, dtype=dtype).view(ref.shape)
