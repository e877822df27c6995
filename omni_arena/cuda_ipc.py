"""CUDA IPC arenas: one device buffer and a small ring of interprocess events, opened once.

Why: a fresh torch IPC handle per tensor per step costs ~95 us p50 (up to 1 ms)
on the receiving side (docs/ARCHITECTURE.md, Arenas: GPU facts behind this).
Exporting one buffer and its events at the handshake and passing (offset, nbytes,
shape, dtype) refs per step costs nothing per step.

Ordering without a host synchronize:
- the producer writes slot k on its current stream, then records `ready[k]`;
- the consumer makes its current stream wait on `ready[k]` before reading,
  and records its own `done[k]` after the reads it enqueued;
- before writing slot k again the producer makes its stream wait on `done[k]`.
A host-level acknowledgement (StepResult for hidden states, the next StepEnd
for the sidecar's plan) says the peer has recorded `done[k]`, so the wait always
refers to the right use of the slot. Waiting on a never-recorded event is a no-op.

This module imports torch, never vllm: the shim and the sidecar both use it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from proto.arena import ArenaError
from proto.messages import ArenaInfo, ArenaKind, CudaIpcInfo
from omni_arena.views import TORCH_DTYPES, dtype_name
from proto.tensors import DTYPE_ITEMSIZE, TensorRef, check_ref

# Torch names this module relies on (torch.multiprocessing's own CUDA sharing uses them).
TORCH_NAMES = [
    ("UntypedStorage", "_share_cuda_"),
    ("UntypedStorage", "_new_shared_cuda"),
    ("cuda.Event", "from_ipc_handle"),
    ("cuda.Event", "ipc_handle"),
]


def check_torch() -> None:
    """Fail at start-up, with the list, if this torch lacks a name we use."""
    missing = []
    for owner, attr in TORCH_NAMES:
        obj = torch
        for part in owner.split("."):
            obj = getattr(obj, part, None)
        if obj is None or not hasattr(obj, attr):
            missing.append(f"torch.{owner}.{attr}")
    if missing:
        raise ArenaError(
            f"torch {torch.__version__} lacks {', '.join(missing)}: CUDA IPC arenas are unavailable; "
            "set OMNI_SIDECAR_ARENA=shm to stage tensors through host shared memory"
        )


def cuda_ipc_available(device: torch.device) -> bool:
    """CUDA proper (not ROCm/XPU/NPU) and a torch with the names above."""
    if device.type != "cuda" or not torch.cuda.is_available() or torch.version.cuda is None:
        return False
    try:
        check_torch()
    except ArenaError:
        return False
    return True


def device_uuid(device: torch.device) -> str:
    return str(torch.cuda.get_device_properties(device).uuid)


def find_device(uuid: str) -> torch.device:
    """This process's index of the GPU with `uuid` (numbering differs per CUDA_VISIBLE_DEVICES)."""
    for i in range(torch.cuda.device_count()):
        if device_uuid(torch.device("cuda", i)) == uuid:
            return torch.device("cuda", i)
    raise ArenaError(
        f"the peer's arena lives on GPU {uuid}, which this process cannot see; run the sidecar "
        "with that GPU visible (CUDA_VISIBLE_DEVICES) or use OMNI_SIDECAR_ARENA=shm"
    )


@dataclass
class OpenCounts:
    """How often this side opened a peer's device buffer / event: must stay once per connection."""

    mem: int = 0
    events: int = 0


def new_event(device: torch.device) -> torch.cuda.Event:
    """An interprocess event that belongs to `device` (torch creates events lazily, on the
    current device: one record here pins it, and completes at once)."""
    event = torch.cuda.Event(enable_timing=False, blocking=False, interprocess=True)
    with torch.cuda.device(device):
        event.record(torch.cuda.current_stream(device))
    return event


def event_handles(events: list[torch.cuda.Event]) -> list[bytes]:
    return [bytes(e.ipc_handle()) for e in events]


def open_events(device: torch.device, handles: list[bytes], counts: OpenCounts) -> list[torch.cuda.Event]:
    events = [torch.cuda.Event.from_ipc_handle(device, h) for h in handles]
    counts.events += len(events)
    return events


class CudaIpcArena:
    """A device byte buffer plus the producer's ready events and the consumer's done events.

    `ready` are recorded by whoever writes the buffer, `done` by whoever reads it;
    each side holds its own events and the peer's opened ones.
    """

    kind: ArenaKind = "cuda_ipc"

    def __init__(self, buf: torch.Tensor, ready: list[torch.cuda.Event], name: str,
                 info: ArenaInfo | None = None) -> None:
        self.buf = buf
        self.size = int(buf.numel())
        self.device = buf.device
        # The stream look-ups below take the index: given a torch.device, torch resolves it in Python
        # on every call (four a step on each side, a cost seen in the H200 profile).
        self._device_index: int = buf.device.index
        self.ready = ready
        self.done: list[torch.cuda.Event] = []
        self.name = name
        self._info = info

    # -- producer ------------------------------------------------------------------

    @classmethod
    def create(cls, size: int, device: torch.device, num_events: int, name: str = "") -> "CudaIpcArena":
        if size <= 0 or num_events < 1:
            raise ArenaError(f"CUDA arena needs a positive size and events, got {size}, {num_events}")
        buf = torch.empty(size, dtype=torch.uint8, device=device)
        return cls(buf, [new_event(device) for _ in range(num_events)], name or f"cuda-{id(buf):x}")

    def info(self) -> ArenaInfo:
        if self._info is None:
            (_dev, handle, storage_size, storage_offset, rc_handle, rc_offset, ev_handle,
             ev_sync) = self.buf.untyped_storage()._share_cuda_()
            cuda = CudaIpcInfo(
                device_uuid=device_uuid(self.device),
                mem_handle=bytes(handle),
                storage_size=int(storage_size),
                storage_offset=int(storage_offset),
                ref_counter_handle=bytes(rc_handle),
                ref_counter_offset=int(rc_offset),
                alloc_event_handle=bytes(ev_handle or b""),
                alloc_event_sync=bool(ev_sync),
                ready_events=event_handles(self.ready),
            )
            self._info = ArenaInfo(kind=self.kind, name=self.name, size=self.size, device="cuda", cuda=cuda)
        return self._info

    def open_peer_done(self, handles: list[bytes], counts: OpenCounts) -> None:
        """The consumer's done events, one per ready event."""
        if len(handles) != len(self.ready):
            raise ArenaError(f"peer sent {len(handles)} done events for {len(self.ready)} slots")
        self.done = open_events(self.device, handles, counts)

    # -- consumer ------------------------------------------------------------------

    @classmethod
    def attach(cls, info: ArenaInfo, counts: OpenCounts) -> "CudaIpcArena":
        """Open the peer's buffer and ready events (once per connection)."""
        cuda = info.cuda
        if info.kind != cls.kind or cuda is None:
            raise ArenaError(f"arena {info.name!r} of kind {info.kind!r} is not a CUDA IPC arena")
        if info.size <= 0 or info.size > cuda.storage_size:
            raise ArenaError(f"arena {info.name!r}: size {info.size} does not fit its storage of {cuda.storage_size}")
        if not cuda.ready_events:
            raise ArenaError(f"arena {info.name!r} offers no ready events")
        device = find_device(cuda.device_uuid)
        with torch.cuda.device(device):
            storage = torch.UntypedStorage._new_shared_cuda(
                device.index, cuda.mem_handle, cuda.storage_size, cuda.storage_offset,
                cuda.ref_counter_handle, cuda.ref_counter_offset, cuda.alloc_event_handle,
                cuda.alloc_event_sync,
            )
            counts.mem += 1
            buf = torch.empty(0, dtype=torch.uint8, device=device)
            buf.set_(storage, 0, (info.size,), (1,))
            ready = open_events(device, list(cuda.ready_events), counts)
        return cls(buf, ready, info.name, info)

    def make_done_events(self) -> list[bytes]:
        """Our done events for the peer's slots; their handles go back in the handshake."""
        self.done = [new_event(self.device) for _ in self.ready]
        return event_handles(self.done)

    # -- both ------------------------------------------------------------------------

    def view(self, ref: TensorRef) -> torch.Tensor:
        """Raw bytes of a ref (the `Arena` protocol's accessor)."""
        check_ref(ref, self.size)
        return self.buf[ref.offset : ref.offset + ref.nbytes]

    def tensor(self, ref: TensorRef) -> torch.Tensor:
        """Bounds-checked typed view of arena bytes (aliasing: copy to keep)."""
        check_ref(ref, self.size)
        dtype = TORCH_DTYPES.get(ref.dtype)
        if dtype is None:
            raise ArenaError(f"tensor ref has unsupported dtype {ref.dtype!r}")
        if ref.nbytes == 0:
            return torch.empty(ref.shape, dtype=dtype, device=self.device)
        if ref.offset % DTYPE_ITEMSIZE[ref.dtype]:
            raise ArenaError(f"tensor ref offset {ref.offset} is not aligned for {ref.dtype}")
        return self.buf[ref.offset : ref.offset + ref.nbytes].view(dtype).view(ref.shape)

    def write(self, offset: int, tensor: torch.Tensor, arena_id: int = 0) -> TensorRef:
        """Device-to-device copy on the current stream; returns the ref (not yet marked ready)."""
        nbytes = tensor.numel() * tensor.element_size()
        name = dtype_name(tensor.dtype)
        ref = TensorRef(arena_id, offset, nbytes, list(tensor.shape), name)
        if nbytes:
            self.tensor(ref).copy_(tensor, non_blocking=True)
        return ref

    def mark_ready(self, slot: int) -> int:
        self.ready[slot].record(torch.cuda.current_stream(self._device_index))
        return slot

    def wait_ready(self, slot: int) -> None:
        if not 0 <= slot < len(self.ready):
            raise ArenaError(f"event {slot} outside the ring of {len(self.ready)}")
        torch.cuda.current_stream(self._device_index).wait_event(self.ready[slot])

    def mark_done(self, slot: int) -> None:
        if self.done:
            self.done[slot].record(torch.cuda.current_stream(self._device_index))

    def wait_done(self, slot: int) -> None:
        if self.done:
            torch.cuda.current_stream(self._device_index).wait_event(self.done[slot])

    def close(self) -> None:
        # Dropping the references releases the mapping (torch closes the IPC handle).
        self.ready, self.done = [], []
        self.buf = torch.empty(0, dtype=torch.uint8)
