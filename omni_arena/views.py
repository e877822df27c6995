"""torch views of arena memory, one implementation for the shim and the sidecar.

The wire's dtype names (proto) are torch's names, so the table derives from them.
An arena is host shared memory (`proto.arena.ShmArena`) or a device buffer
(`omni_arena.cuda_ipc.CudaIpcArena`); either way a ref is bounds-checked first.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import torch

from proto.arena import Arena, ShmArena
from proto.tensors import DTYPE_ITEMSIZE, TensorRef, TensorRefError, check_ref

if TYPE_CHECKING:
    from omni_arena.cuda_ipc import CudaIpcArena

TORCH_DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in DTYPE_ITEMSIZE}


_DTYPE_NAMES: dict[torch.dtype, str] = {dtype: name for name, dtype in TORCH_DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    """The wire's name of a dtype (a table look-up: it runs for every tensor a plan carries)."""
    name = _DTYPE_NAMES.get(dtype)
    return name if name is not None else str(dtype).removeprefix("torch.")


def torch_dtype(name: str) -> torch.dtype:
    try:
        return TORCH_DTYPES[name]
    except KeyError:
        raise ValueError(f"unsupported dtype {name!r}") from None


def check_arena_ref(arena: Arena, ref: TensorRef) -> torch.dtype:
    """What `arena_tensor` checks (bounds, byte count, dtype; alignment to the dtype), without making
    the view: the dtype. TensorRefError or ValueError (an unknown dtype): a peer's bad ref."""
    check_ref(ref, arena.size)
    dtype = torch_dtype(ref.dtype)
    if ref.nbytes and ref.offset % DTYPE_ITEMSIZE[ref.dtype]:
        raise TensorRefError(f"tensor ref offset {ref.offset} is not aligned for {ref.dtype}")
    return dtype


def arena_tensor(arena: Arena, ref: TensorRef) -> torch.Tensor:
    """A tensor aliasing the bytes `ref` names (bounds-checked); copy to keep it."""
    if arena.kind == "cuda_ipc":
        return cast("CudaIpcArena", arena).tensor(ref)
    dtype = torch_dtype(ref.dtype)
    mv = cast(ShmArena, arena).view(ref)
    if ref.nbytes == 0:
        return torch.empty(ref.shape, dtype=dtype)
    return torch.frombuffer(mv, dtype=dtype).view(ref.shape)


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
