"""The step's hidden slots: a step's hidden states and model results into our arena, one slot a step.

Host arenas (`kind == "shm"`) are plain memory; device arenas (`"cuda_ipc"`)
order their writes with events: a slot is rewritten only after the sidecar's
done event for its previous use (docs/ARCHITECTURE.md, "Arenas").
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from omni_arena.views import arena_tensor, dtype_name
from proto.arena import SlotRing, align_up
from proto.tensors import TensorRef
from worker_shim.errors import SidecarError


def hidden_arena_size(max_num_tokens: int, hidden_size: int, itemsize: int, slots: int,
                      model_io_bytes: int = 0, rows_per_token: int = 1) -> int:
    """Per slot: a step's hidden rows and `rows_per_token - 1` captured layers' rows, then room
    for its model updates and outputs."""
    rows = align_up(max_num_tokens * hidden_size * itemsize) * rows_per_token
    return (rows + align_up(model_io_bytes) + 64) * slots


# Slot views kept (HiddenSlots._views): a steady decode needs slots x (1 + captured layers); the
# bound only keeps prefill steps (a new row count each) from growing it without end.
VIEWS_KEPT = 64


class HiddenSlots:
    """The hidden-state arena cut into slots written round-robin, one per step.

    A step's slot holds its hidden rows, then its model updates and outputs
    (docs/ARCHITECTURE.md, "Model hooks"). A slot may be rewritten only once the
    sidecar answered the step that last used it (its StepResult says it is done reading).
    """

    def __init__(self, arena: Any, num_slots: int) -> None:
        self.arena = arena
        self._slots = SlotRing(arena.size, num_slots)
        # Typed views of slot bytes by (offset, dtype, shape): a steady step puts the same shapes at the
        # same offsets of each slot, and making the view (a check, a slice, two views) cost as much as
        # the copy's launch, three tensors a step on the H200 host (hidden rows and two captured layers).
        self._views: dict[tuple, torch.Tensor] = {}

    def claim(self, step: int, wait_answered: Callable[[int], None]) -> "StepSlot":
        """`step`'s slot, once its previous reader is done; `wait_answered(s)` blocks until
        step s's result arrived."""
        slots = self._slots
        slot = slots.slot_of(step)
        reader = slots.owner_step[slot]
        if reader is not None:
            wait_answered(reader)
            slots.owner_step[slot] = None
        if self.arena.kind != "shm":
            self.arena.wait_done(slot)  # the sidecar's reads of this slot's previous use
        return StepSlot(self.arena, slot, slots.offset(slot), slots.slot_size, self._views, (slots, step))



class StepSlot:
    """One step's slot, filled front to back; `seal` once everything is in."""

    def __init__(self, arena: Any, slot: int, start: int, size: int,
                 views: dict[tuple, torch.Tensor] | None = None, owner: tuple[SlotRing, int] | None = None) -> None:
        self.arena = arena
        self.slot = slot
        self.start = start
        self.end = start + size
        self.offset = start
        # A tensor put twice (state and output) is stored once; kept alive so its id stays its own.
        self._refs: dict[int, tuple[torch.Tensor, TensorRef]] = {}
        self._views = {} if views is None else views  # HiddenSlots': kept across steps
        self._owner = owner  # (the ring of slots, the step this one is claimed for)

    def put(self, tensor: torch.Tensor, steady: bool = False) -> TensorRef:
        """`tensor` into the slot; `steady`: one of the tensors every step puts at the same place
        (hidden rows, captured layers), whose slot view is kept for the next steps (model results
        vary in number and shape: theirs are made each time)."""
        known = self._refs.get(id(tensor))
        if known is not None:
            return known[1]
        nbytes = tensor.numel() * tensor.element_size()
        self._check_room(nbytes)
        shape = tensor.shape
        ref = TensorRef(0, self.offset, nbytes, list(shape), dtype_name(tensor.dtype))
        if nbytes:
            dst = self._view(ref, tensor.dtype, shape, steady)
            if self.arena.kind == "shm":
                dst.copy_(tensor.detach())  # host staging
            else:
                dst.copy_(tensor.detach(), non_blocking=True)
        self.offset = align_up(self.offset + max(nbytes, 1))
        self._refs[id(tensor)] = (tensor, ref)
        return ref

    def _check_room(self, nbytes: int) -> None:
        if self.offset + nbytes > self.end:
            raise SidecarError(
                f"step data of {self.offset - self.start + nbytes} bytes exceed the arena slot of "
                f"{self.end - self.start} (raise omni_sidecar model_io_mib)"
            )

    def _view(self, ref: TensorRef, dtype: torch.dtype, shape: tuple, steady: bool) -> torch.Tensor:
        """The slot's bytes `ref` names, typed and shaped (bounds-checked); a steady tensor's view is
        kept for the next steps, which put the same shape at the same place."""
        if not steady:
            return arena_tensor(self.arena, ref)
        views, key = self._views, (ref.offset, dtype, shape)
        dst = views.get(key)
        if dst is None:
            dst = arena_tensor(self.arena, ref)
            if len(views) >= VIEWS_KEPT:  # prefill shapes vary: bounded, steady decode refills it
                views.clear()
            views[key] = dst
        return dst

    def put_layers(self, layers: dict[int, torch.Tensor] | None) -> dict[int, TensorRef]:
        """Captured layers' rows (HookNeeds.hidden_layers), after the hidden rows."""
        return {n: self.put(rows, steady=True) for n, rows in (layers or {}).items()}

    def put_hidden(self, hidden: torch.Tensor, layers: dict[int, torch.Tensor] | None
                   ) -> tuple[TensorRef, dict[int, TensorRef]]:
        """The step's hidden rows, then each captured layer's: one stacked copy when they share shape,
        dtype and device (a copy's launch each costs ~15 µs of the shim's StepEnd on the H200 host),
        else one copy each. The blocks lie back to back, each a ref."""
        rows = [hidden, *(layers or {}).values()]
        if (len(rows) == 1 or not hidden.numel() or self.offset != self.start
                or any(r.shape != hidden.shape or r.dtype != hidden.dtype or r.device != hidden.device for r in rows[1:])):
            return self.put(hidden, steady=True), self.put_layers(layers)
        nbytes = hidden.numel() * hidden.element_size()
        total = nbytes * len(rows)
        self._check_room(total)
        shape, dtype = list(hidden.shape), dtype_name(hidden.dtype)
        dst = self._view(TensorRef(0, self.offset, total, [len(rows), *shape], dtype), hidden.dtype,
                         (len(rows), *hidden.shape), steady=True)
        self._stack_into(dst, rows)
        refs = [TensorRef(0, self.offset + k * nbytes, nbytes, shape, dtype) for k in range(len(rows))]
        for tensor, ref in zip(rows, refs):
            self._refs[id(tensor)] = (tensor, ref)
        self.offset = align_up(self.offset + total)
        return refs[0], dict(zip((layers or {}).keys(), refs[1:]))

    def put_stack(self, rows: list[torch.Tensor]) -> TensorRef:
        """Tensors of one dtype, shape and device (a tree's kind: the model's results) stacked straight
        into the slot, one write (no stacked copy made first)."""
        first = rows[0]
        shape = (len(rows), *first.shape)
        nbytes = first.numel() * first.element_size() * len(rows)
        self._check_room(nbytes)
        ref = TensorRef(0, self.offset, nbytes, list(shape), dtype_name(first.dtype))
        if nbytes:
            self._stack_into(self._view(ref, first.dtype, shape, steady=False), rows)
        self.offset = align_up(self.offset + max(nbytes, 1))
        return ref

    def _stack_into(self, dst: torch.Tensor, rows: list[torch.Tensor]) -> None:
        with torch.no_grad():
            if dst.device == rows[0].device:
                torch.stack([r.detach() for r in rows], out=dst)
            else:  # host staging of device rows (no IPC): stacked there, one copy over
                dst.copy_(torch.stack([r.detach() for r in rows]), non_blocking=self.arena.kind != "shm")

    @property
    def used(self) -> bool:
        return self.offset > self.start

    def seal(self) -> int:
        """The ready event the sidecar waits on (-1 on host memory)."""
        return -1 if self.arena.kind == "shm" else self.arena.mark_ready(self.slot)

    def sent(self) -> None:
        """The step's StepEnd is on its way: the slot is the sidecar's until that step's result."""
        if self._owner is not None:
            ring, step = self._owner
            ring.owner_step[self.slot] = step
