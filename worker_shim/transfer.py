"""Tensors across the arenas: a step's hidden states and model results into our hidden slots,
the plan's tensors out of the sidecar's arena (read by worker_shim/plan_read.py).

Host arenas (`kind == "shm"`) are plain memory; device arenas (`"cuda_ipc"`)
order their reads and writes with events: a slot is rewritten only after the
sidecar's done event for its previous use, and the sidecar's arena is read
only after its ready event (docs/ARCHITECTURE.md, "Arena slots").
"""

from __future__ import annotations

import weakref
from typing import Any, Callable

import torch

from omni_arena.views import arena_tensor, dtype_name
from proto.arena import SlotRing, align_up
from proto.messages import StepPlan
from proto.tensors import TensorRef
from worker_shim.channel import SidecarError
from worker_shim.plan_read import KWARGS, STATES, PlanLanding, StackReader, copy_out_trees


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
        return StepSlot(self.arena, slot, slots.offset(slot), slots.slot_size, self._views)

    def write(self, step: int, hidden: torch.Tensor, wait_answered: Callable[[int], None],
              layers: dict[int, torch.Tensor] | None = None) -> tuple[TensorRef, dict[int, TensorRef], int]:
        """`hidden` (then each captured layer's rows) alone into `step`'s slot: their refs and
        the slot's ready event."""
        slot = self.claim(step, wait_answered)
        ref, layer_refs = slot.put_hidden(hidden, layers)
        return ref, layer_refs, slot.seal()

    def sent(self, step: int) -> None:
        """`step`'s StepEnd is on its way: its slot is the sidecar's until that step's result."""
        slots = self._slots
        slots.owner_step[slots.slot_of(step)] = step


class StepSlot:
    """One step's slot, filled front to back; `seal` once everything is in."""

    def __init__(self, arena: Any, slot: int, start: int, size: int,
                 views: dict[tuple, torch.Tensor] | None = None) -> None:
        self.arena = arena
        self.slot = slot
        self.start = start
        self.end = start + size
        self.offset = start
        # A tensor put twice (state and output) is stored once; kept alive so its id stays its own.
        self._refs: dict[int, tuple[torch.Tensor, TensorRef]] = {}
        self._views = {} if views is None else views  # HiddenSlots': kept across steps

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
        dtype and device (a copy's launch each was ~15 µs of the shim's StepEnd on the H200 host,
        BENCHMARKS.md session 14), else one copy each. The blocks lie back to back, each a ref."""
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
        with torch.no_grad():
            if dst.device == hidden.device:
                torch.stack([r.detach() for r in rows], out=dst)
            else:  # host staging of device rows (no IPC): stacked there, one copy over
                dst.copy_(torch.stack([r.detach() for r in rows]), non_blocking=self.arena.kind != "shm")
        refs = [TensorRef(0, self.offset + k * nbytes, nbytes, shape, dtype) for k in range(len(rows))]
        for tensor, ref in zip(rows, refs):
            self._refs[id(tensor)] = (tensor, ref)
        self.offset = align_up(self.offset + total)
        return refs[0], dict(zip((layers or {}).keys(), refs[1:]))

    @property
    def used(self) -> bool:
        return self.offset > self.start

    def seal(self) -> int:
        """The ready event the sidecar waits on (-1 on host memory)."""
        return -1 if self.arena.kind == "shm" else self.arena.mark_ready(self.slot)


def read_states(arena: Any, plan: StepPlan) -> dict[str, Any]:
    """The plan's model states, as host copies (vllm-omni keeps decoded payloads on the host).

    Call before `read_plan`, which lets the sidecar reuse its arena once our copies ran."""
    if not plan.model_states:
        return {}
    if arena is not None and arena.kind != "shm" and plan.event >= 0:
        arena.wait_ready(plan.event)
    # Each state is kept for its request's lifetime (the model's state mirror): tensors of their own.
    cpu = torch.device("cpu")
    if type(plan.model_states) is bytes:
        states = StackReader(arena, plan.stacks, cpu, own=True).decode(plan.model_states, STATES)
    else:
        states = dict(zip(plan.model_states, copy_out_trees(arena, list(plan.model_states.values()), cpu,
                                                            plan.stacks, own=True)))
    bad = [r for r, v in states.items() if not isinstance(v, dict)]
    if bad:
        raise SidecarError(f"sidecar sent model states that are not dicts for {bad[:4]}")
    return states


def read_plan(arena: Any, plan: StepPlan, input_batch: Any, model: Any,
              embeds: torch.Tensor | None, landing: PlanLanding | None = None) -> dict[str, Any]:
    """The plan's extra model inputs, copied out of the sidecar's arena.

    `embeds` is the persistent inputs_embeds buffer (already holding this
    step's token embeddings) when the runner feeds the model from one: overlay
    rows are written into it in place, so CUDA graphs see them. `landing`: a 1.8
    plan's kwargs land in its buffers, their views kept from step to step
    (worker_shim/plan_read.py); without it, in a copy of their own.
    """
    if not (plan.extra_kwargs or plan.overlays or plan.model_states):
        return {}
    on_device = arena is not None and arena.kind != "shm"
    if on_device and plan.event >= 0:
        arena.wait_ready(plan.event)  # the sidecar's writes, ordered on our stream
    extra: dict[str, Any] = {}
    if type(plan.extra_kwargs) is bytes:
        extra = StackReader(arena, plan.stacks, model_device(model), False, landing).decode(plan.extra_kwargs, KWARGS)
    elif plan.extra_kwargs:
        device = model_device(model)
        extra = copy_out_trees(arena, [plan.extra_kwargs], device, plan.stacks)[0]
        if not isinstance(extra, dict):  # a tree whose root is one tensor: not keyword arguments
            raise SidecarError(f"sidecar sent extra kwargs that are a {type(extra).__name__}, not a dict")
    if plan.overlays:
        extra["inputs_embeds"] = _overlay(arena, plan, input_batch, model, embeds)
    if on_device:
        arena.mark_done(0)  # the sidecar may rewrite its arena once our copies ran
    return extra


def _overlay(arena: Any, plan: StepPlan, input_batch: Any, model: Any,
             embeds: torch.Tensor | None) -> torch.Tensor:
    if arena is None:
        raise SidecarError("sidecar sent overlays but offered no arena")
    if embeds is None:
        n = int(input_batch.num_tokens_after_padding)
        embeds = model.embed_input_ids(input_batch.input_ids[:n])
    checked = []  # all overlays are checked before any is written: the buffer may be the model's
    for ov in plan.overlays:
        rows = arena_tensor(arena, ov.rows)
        end = ov.row_start + rows.shape[0]
        if end > int(input_batch.num_tokens) or rows.dim() != 2 or rows.shape[1] != embeds.shape[1]:
            raise SidecarError(
                f"overlay rows [{ov.row_start}, {end}) x {list(rows.shape)} do not fit the "
                f"batch of {input_batch.num_tokens} tokens x {embeds.shape[1]}"
            )
        checked.append((ov.row_start, end, rows))
    for start, end, rows in checked:
        embeds[start:end].copy_(rows.to(device=embeds.device, dtype=embeds.dtype))
    return embeds


_DEVICES: "weakref.WeakKeyDictionary[Any, torch.device]" = weakref.WeakKeyDictionary()


def model_device(model: Any) -> torch.device:
    """The device of the model's first parameter, looked up once per model: walking its modules
    to the first parameter cost ~30 µs of every step's plan read on a GPU host."""
    try:
        return _DEVICES[model]
    except (KeyError, TypeError):  # TypeError: a model without weak references (a test's stand-in)
        pass
    device = next((param.device for param in model.parameters()), torch.device("cpu"))
    try:
        _DEVICES[model] = device
    except TypeError:
        pass
    return device
