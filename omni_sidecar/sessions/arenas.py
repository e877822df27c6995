"""A session's shared memory: the shim's arenas it reads, its own arena it writes.

Tensor moves of a step live here: hidden states read from the shim's arena,
overlay rows and extra-kwargs tensors written into the sidecar's arena (the
message carries their refs). See docs/ARCHITECTURE.md (arenas) for when a slot
may be reused.
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch

from omni_arena.tensor_tree import Tree, TreeDecoder, TreeEncoder
from omni_arena.views import TORCH_DTYPES, arena_tensor, dtype_name
from omni_sidecar.serve.metrics import SidecarMetrics
from proto.arena import ArenaError, ShmArena, align_up
from proto.messages import MAX_PLAN_TENSORS, Hello, Overlay, ReqId, StepEnd
from proto.tensors import DTYPE_ITEMSIZE, TensorRef

OUT_ARENA_SLACK = 1 << 20  # room for per-tensor alignment next to the overlay rows


class OutArena:
    """The sidecar->shim arena, filled from offset 0 for each plan.

    Safe to reuse per step: the shim copies everything out of it before it
    sends the next message. On a CUDA IPC arena the copies are only enqueued
    then, so `reset` makes our stream wait on the shim's done event first and
    `seal` records the ready event the shim's stream waits on.
    """

    def __init__(self, arena: Any) -> None:
        self.arena = arena
        self.offset = 0
        self.device = arena.kind != "shm"
        # Host tensors bound for a device arena wait here and go up together (`_flush`): a
        # pageable host->device copy per tensor made the sidecar wait on the device each time,
        # once per request every step when per-request state rides in the extra kwargs. And one
        # pageable copy still may wait (the driver stages it behind our stream, which waits on the
        # step's forward): so the staging is pinned and copied up without waiting, a fresh buffer
        # from torch's caching host allocator after each copy (which reuses a block only once the
        # copy that read it ran: a host write must never race the copy still queued).
        self._staging: torch.Tensor | None = None
        self._pinned = self.device and torch.cuda.is_available()
        self._run_start = -1  # first staged byte not yet copied up; -1: none
        # Host arena: its bytes as one tensor, held from the first put until `close`, so a tensor goes
        # in with one memmove (a view and a copy_ per tensor cost ~7 µs, 128 tensors a step at 64
        # requests when per-request state rides in the extra kwargs).
        self._host: torch.Tensor | None = None
        self.stacks: list[TensorRef] = []  # this plan's tensors (StepPlan.stacks)
        self.stacked_rows = 0  # tensors this plan sends as rows of a stack (not those used whole)

    def reset(self) -> None:
        if self.device and self.offset:
            self.arena.wait_done(0)
        self.offset = 0
        self._run_start = -1
        self.stacks = []  # a new list: a plan already made keeps its own
        self.stacked_rows = 0

    def _check_room(self, nbytes: int) -> None:
        if self.offset + nbytes > self.arena.size:
            raise ArenaError(
                f"step needs more than the {self.arena.size}-byte sidecar arena "
                "(raise it with --arena-mib)"
            )

    def put(self, tensor: torch.Tensor) -> TensorRef:
        nbytes = tensor.nbytes
        self._check_room(nbytes)
        if not self.device:
            ref = self._copy_in(tensor, nbytes)
        elif tensor.device.type == "cpu":
            ref = self._stage(tensor.detach(), nbytes)
        else:
            self._flush()  # staged bytes first: the runs must not cover what this copy writes
            ref = self.arena.write(self.offset, tensor.detach().to(self.arena.device))
        self.offset = align_up(self.offset + max(nbytes, 1))
        return ref

    def put_rows(self, tensors: list[torch.Tensor]) -> list[TensorRef]:
        """Tensors of one dtype, device and row shape (`rows_alike`: a prefill step's overlay rows, a
        request's each) written back to back by one `torch.cat`, each ref a run of rows of it: one
        write and one copy up, not one per request (64 requests' staging copies were the sidecar's
        longest step on the H200 host)."""
        if not rows_alike(tensors):
            raise ValueError("put_rows takes tensors of one dtype, device and row shape")
        first = tensors[0]
        nbytes = sum(t.nbytes for t in tensors)
        self._check_room(nbytes)
        self._join_into(tensors, [sum(t.shape[0] for t in tensors), *first.shape[1:]], nbytes, torch.cat)
        refs, at, dtype = [], self.offset, dtype_name(first.dtype)
        for t in tensors:
            refs.append(TensorRef(0, at, t.nbytes, list(t.shape), dtype))
            at += t.nbytes
        self.offset = align_up(self.offset + max(nbytes, 1))
        return refs

    def put_whole(self, tensor: torch.Tensor) -> int:
        """A tensor no stack can hold as a stack of the plan used whole: its index in `stacks`."""
        self._check_count()
        self.stacks.append(self.put(tensor))
        return len(self.stacks) - 1

    def _check_count(self) -> None:
        if len(self.stacks) >= MAX_PLAN_TENSORS:
            raise ArenaError(f"a plan holds more than {MAX_PLAN_TENSORS} tensors")

    def put_stack(self, tensors: list[torch.Tensor]) -> int:
        """Same-shaped tensors (one dtype and device) stacked into the arena as one tensor, written in
        place by one `torch.stack`; its index in this plan's `stacks` (omni_arena/tensor_tree.py, TreeEncoder)."""
        self._check_count()
        first = tensors[0]
        shape = [len(tensors), *first.shape]
        nbytes = first.nbytes * len(tensors)
        self._check_room(nbytes)
        self._join_into(tensors, shape, nbytes, torch.stack)
        self.stacks.append(TensorRef(0, self.offset, nbytes, shape, dtype_name(first.dtype)))
        self.stacked_rows += len(tensors)
        self.offset = align_up(self.offset + nbytes)
        return len(self.stacks) - 1

    def _join_into(self, tensors: list[torch.Tensor], shape: list[int], nbytes: int, join: Any) -> None:
        """`join(tensors)` (torch.stack or torch.cat, of one dtype and device) written at `offset` as
        `shape`: into the host arena, the staging (host tensors bound for a device arena) or the
        device arena once the staged runs went up (offsets are ALIGN-aligned: any dtype fits)."""
        end, first = self.offset + nbytes, tensors[0]
        if not self.device:
            if self._host is None:
                self._host = torch.frombuffer(self.arena.raw(0, self.arena.size), dtype=torch.uint8)
            region = self._host[self.offset : end]
        elif first.device.type == "cpu":
            region = self._staged(end)
        else:
            self._flush()  # staged bytes first: the runs must not cover what this write makes
            region = self.arena.buf[self.offset : end]
        if not nbytes:
            return
        dst = region.view(first.dtype).view(shape)
        with torch.no_grad():  # out= refuses tensors that require grad otherwise; `put` detaches alike
            if dst.device == first.device:
                join(tensors, out=dst)  # resolves lazy neg/conj as it writes
            else:
                dst.copy_(join(tensors))

    def close(self) -> None:
        """Let go of the arena (the bytes' tensor first: a mapping a tensor still views stays mapped)."""
        self._host = None
        self._staging = None
        self.arena.close()

    def _copy_in(self, tensor: torch.Tensor, nbytes: int) -> TensorRef:
        """A tensor into the host arena at `offset` (bounds checked by `put`): one memmove."""
        # The memmove reads the tensor's bytes as they lie: only a dense host tensor's bytes are its values.
        if not (tensor.is_cpu and tensor.is_contiguous()) or tensor.is_conj() or tensor.is_neg():
            tensor = tensor.detach().cpu().contiguous().resolve_conj().resolve_neg()
        if nbytes:
            if self._host is None:
                self._host = torch.frombuffer(self.arena.raw(0, self.arena.size), dtype=torch.uint8)
            ctypes.memmove(self._host.data_ptr() + self.offset, tensor.data_ptr(), nbytes)
        return TensorRef(0, self.offset, nbytes, list(tensor.shape), dtype_name(tensor.dtype))

    def seal(self) -> int:
        """The event index the shim waits on (-1: nothing written, or host memory)."""
        if not self.device or not self.offset:
            return -1
        self._flush()
        return self.arena.mark_ready(0)

    def _staged(self, end: int) -> torch.Tensor:
        """The staging bytes for the arena's [offset, end): the run (from its first staged byte, not
        from the arena's start: a pinned block the size of what is staged) grown to hold them, what
        it holds kept."""
        if self._run_start < 0:
            self._run_start = self.offset
        base, staging = self._run_start, self._staging
        if staging is None or staging.numel() < end - base:
            size = min(self.arena.size, max(end - base, 2 * (0 if staging is None else staging.numel())))
            grown = torch.empty(size, dtype=torch.uint8, pin_memory=self._pinned)
            if staging is not None:
                kept = min(self.offset - base, staging.numel())  # past it: alignment padding only
                grown[:kept] = staging[:kept]
            self._staging = staging = grown
        return staging[self.offset - base : end - base]

    def _stage(self, tensor: torch.Tensor, nbytes: int) -> TensorRef:
        staged = self._staged(self.offset + nbytes)
        if nbytes:
            # A byte view reads the bytes as stored: a lazy negation or conjugation must be applied first.
            dense = tensor.resolve_conj().resolve_neg().contiguous()
            staged[:] = dense.reshape(-1).view(torch.uint8)
        return TensorRef(0, self.offset, nbytes, list(tensor.shape), dtype_name(tensor.dtype))

    def _flush(self) -> None:
        """One copy of the staged run (alignment gaps included) into the device arena, on our stream."""
        if self._run_start < 0 or self._staging is None:
            return
        start, size = self._run_start, min(self.offset - self._run_start, self._staging.numel())
        self._run_start = -1
        if size > 0:
            self.arena.buf[start : start + size].copy_(self._staging[:size], non_blocking=self._pinned)
        if self._pinned:
            self._staging = None  # its block goes back to the allocator, reused once this copy ran


def rows_alike(tensors: list[torch.Tensor]) -> bool:
    """Of one dtype, device and row shape: rows one `torch.cat` joins (`OutArena.put_rows`)."""
    first = tensors[0]
    return all(t.dim() >= 1 and t.shape[1:] == first.shape[1:] and t.dtype == first.dtype
               and t.device == first.device for t in tensors)


class SessionArenas:
    """The arenas of one shim connection and the tensor moves through them."""

    def __init__(self, session_id: int, hello: Hello, metrics: SidecarMetrics) -> None:
        self.session_id = session_id
        self.hello = hello
        self.metrics = metrics
        self.inputs: list[Any] = []  # the shim's: ShmArena or CudaIpcArena
        self.out: OutArena | None = None
        self.opens: Any = None  # CUDA IPC OpenCounts
        self.consumer_events: list[bytes] = []
        self.wanted_layers: list[int] = []  # the hooks' HookNeeds.hidden_layers
        # Overlay rows go out in the shim's dtype, its Hello's (None: one `open` refuses), looked up once.
        self.rows_dtype = TORCH_DTYPES.get(hello.dtype)
        self._ready_for: StepEnd | None = None  # the StepEnd whose slot our stream already waits for
        self._encoder = TreeEncoder()

    def open(self, wants_out: bool, min_out_bytes: int) -> None:
        """Map the shim's arenas; create ours for overlay rows / kwargs if the hooks need one.

        CUDA IPC: each device buffer and event is opened here, once per connection
        (`opens` counts them); our done events for the shim's slots go back in the Welcome.
        """
        for info in self.hello.arenas:
            if info.kind == "cuda_ipc":
                from omni_arena.cuda_ipc import CudaIpcArena, OpenCounts

                self.opens = self.opens or OpenCounts()
                arena = CudaIpcArena.attach(info, self.opens)
                self.consumer_events = arena.make_done_events()
                self.inputs.append(arena)
            else:
                self.inputs.append(ShmArena.attach(info))
        if wants_out:
            if self.hello.dtype not in DTYPE_ITEMSIZE:
                raise ArenaError(f"shim announced unknown dtype {self.hello.dtype!r}")
            itemsize = DTYPE_ITEMSIZE[self.hello.dtype]
            rows_bytes = self.hello.max_num_tokens * self.hello.hidden_size * itemsize
            size = max(align_up(max(1, rows_bytes)) + OUT_ARENA_SLACK, min_out_bytes)
            self.out = OutArena(self._create_out(size))
            self.metrics.arena_bytes.labels("sidecar_to_shim").inc(size)
        self.metrics.arena_bytes.labels("shim_to_sidecar").inc(sum(a.size for a in self.inputs))

    def _create_out(self, size: int) -> Any:
        """Same kind as the shim's: device memory when the shim offered CUDA IPC."""
        device_in = [a for a in self.inputs if a.kind != "shm"]
        if not device_in:
            return ShmArena.create(size, prefix=f"omni-sidecar-s{self.session_id}")
        from omni_arena.cuda_ipc import CudaIpcArena

        arena = CudaIpcArena.create(size, device_in[0].device, 1, name=f"omni-sidecar-s{self.session_id}")
        arena.open_peer_done(list(self.hello.consumer_events), self.opens)
        return arena

    def close(self) -> None:
        for arena in self.inputs:
            self.metrics.arena_bytes.labels("shim_to_sidecar").dec(arena.size)
            arena.close()
        if self.out is not None:
            self.metrics.arena_bytes.labels("sidecar_to_shim").dec(self.out.arena.size)
            self.out.close()
        self.inputs.clear()
        self.out = None

    # -- per step ------------------------------------------------------------

    def hidden(self, msg: StepEnd) -> torch.Tensor | None:
        """The step's hidden rows, a view valid until `release_slot`."""
        return None if msg.hidden is None else self._slot_tensor(msg, msg.hidden)

    def model_results(self, msg: StepEnd) -> tuple[dict[ReqId, Any], dict[ReqId, Any]]:
        """The step's model updates and outputs, each tensor a copy of its own out of its slot
        (every ref checked when first named; TreeError or ArenaError for a bad tree or ref)."""
        tensors = msg.tensors
        decoder = TreeDecoder(len(tensors), lambda k: self._slot_tensor(msg, tensors[k]), own=True,
                              copy_budget=sum(ref.nbytes for ref in tensors))
        return decoder.decode(msg.model_updates, dict[ReqId, Any]), decoder.decode(msg.model_outputs, dict[ReqId, Any])

    def _slot_tensor(self, msg: StepEnd, ref: TensorRef) -> torch.Tensor:
        if ref.arena >= len(self.inputs):
            raise ArenaError(f"a tensor of step {msg.step} names arena {ref.arena}, which was never offered")
        arena = self.inputs[ref.arena]
        if arena.kind != "shm" and self._ready_for is not msg:
            # The shim's copies, ordered on our stream: once per StepEnd (its hidden rows, captured layers
            # and model results share one ready event; a wait each was a stream look-up and a wait each).
            arena.wait_ready(msg.hidden_event)
            self._ready_for = msg
        return arena_tensor(arena, ref)  # bounds-checked against the arena

    def hidden_layers(self, msg: StepEnd) -> dict[int, torch.Tensor]:
        """Captured layers' rows (written with the hidden rows into the step's slot), views
        valid until `release_slot`."""
        unasked = set(msg.hidden_layers) - set(self.wanted_layers)
        if unasked or (msg.hidden_layers and msg.hidden is None):
            raise ArenaError(f"shim sent hidden layers {sorted(msg.hidden_layers)}; the hooks asked for "
                             f"{sorted(self.wanted_layers)} with the hidden states")
        return {n: self._slot_tensor(msg, ref) for n, ref in msg.hidden_layers.items()}

    def release_slot(self, msg: StepEnd) -> None:
        """CUDA IPC: the shim may rewrite the slot once the reads we enqueued ran."""
        self._ready_for = None
        if msg.hidden_event >= 0 and self.inputs and self.inputs[0].kind != "shm":
            self.inputs[0].mark_done(msg.hidden_event)

    def write_overlays(self, pairs: list[tuple[int, torch.Tensor]]) -> list[Overlay]:
        if not pairs:
            return []
        if self.out is None:
            raise RuntimeError("hook set returned overlay rows but declared pre_forward='never'")
        want = self.rows_dtype
        rows = [r.detach().to(want) for _, r in pairs]
        if len(rows) > 1 and rows_alike(rows):
            refs = self.out.put_rows(rows)  # the common case: one write for the step's overlays
        else:
            refs = [self.out.put(r) for r in rows]
        return [Overlay(row_start, ref) for (row_start, _), ref in zip(pairs, refs)]

    def encode_tree(self, value: Tree) -> bytes:
        """Extra kwargs or model states as a plan's tree (proto/plan_trees.py): its tensors go into the
        arena as the plan's stacks, the tree's marks naming them (b"" for an empty tree)."""
        out = self.out
        if out is None:
            return self._encoder.encode(value, _no_arena, _no_arena)
        return self._encoder.encode(value, out.put_whole, out.put_stack, len(out.stacks))

    @property
    def stacks(self) -> list[TensorRef]:
        """This plan's tensors (the list a plan made keeps: `reset` starts a new one)."""
        return self.out.stacks if self.out is not None else []


def _no_arena(tensors: Any) -> int:
    raise RuntimeError("the plan holds tensors but the hook set has no arena")
