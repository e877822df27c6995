"""An arena with a device arena's interface over host bytes, for the sidecar's OutArena on a CPU host."""

from __future__ import annotations

import torch

from proto.tensors import TensorRef


class DeviceLikeArena:
    """A device arena's interface over host bytes: staged host tensors go up in `_flush`; tensors
    already "on the device" (meta here) are written at once and marked, so a flush that covered
    them would show."""

    kind = "fake-device"
    device = torch.device("meta")

    def __init__(self, size: int) -> None:
        self.size = size
        self.buf = torch.zeros(size, dtype=torch.uint8)
        self.device_writes: list[tuple[int, int]] = []
        self.ready_marks = 0

    def write(self, offset: int, tensor: torch.Tensor, arena_id: int = 0) -> TensorRef:
        nbytes = tensor.numel() * tensor.element_size()
        self.buf[offset : offset + nbytes] = 0xAB
        self.device_writes.append((offset, nbytes))
        return TensorRef(arena_id, offset, nbytes, list(tensor.shape), "float32")

    def mark_ready(self, slot: int) -> int:
        self.ready_marks += 1
        return slot

    def wait_done(self, slot: int) -> None:
        pass
