"""Tensors across the arenas: hidden states into our hidden slots, the plan's tensors out of the sidecar's arena.

Host arenas (`kind == "shm"`) are plain memory; device arenas (`"cuda_ipc"`)
order their reads and writes with events: a slot is rewritten only after the
sidecar's done event for its previous use, and the sidecar's arena is read
only after its ready event (docs/ARCHITECTURE.md, "Arena slots").
"""

from __future__ import annotations

from typing import Any, Callable

import msgspec
import torch

from omni_arena.views import arena_tensor, dtype_name
from proto.arena import SlotRing, align_up
from proto.messages import StepPlan
from proto.tensors import TENSOR_MARKER, TensorRef
from worker_shim.channel import SidecarError

MAX_KWARG_DEPTH = 8


def hidden_arena_size(max_num_tokens: int, hidden_size: int, itemsize: int, slots: int,
                      rows_per_token: int = 1) -> int:
    """Per slot: the last-layer hidden rows and `rows_per_token - 1` captured layers' rows."""
    return (align_up(max_num_tokens * hidden_size * itemsize) * rows_per_token + 64) * slots


class HiddenSlots:
    """The hidden-state arena cut into slots written round-robin, one per step.

    A slot may be rewritten only once the sidecar answered the step that last
    used it (its StepResult says it is done reading).
    """

    def __init__(self, arena: Any, num_slots: int) -> None:
        self.arena = arena
        self._slots = SlotRing(arena.size, num_slots)

    def write(self, step: int, hidden: torch.Tensor, wait_answered: Callable[[int], None],
              layers: dict[int, torch.Tensor] | None = None) -> tuple[TensorRef, dict[int, TensorRef], int]:
        """Copy `hidden` (then each captured layer's rows) into `step`'s slot; returns their
        refs and the ready event (-1 on host memory).

        `wait_answered(s)` blocks until step s's result arrived (the slot's previous reader).
        """
        slots = self._slots
        slot = slots.slot_of(step)
        reader = slots.owner_step[slot]
        if reader is not None:
            wait_answered(reader)
            slots.owner_step[slot] = None
        tensors = [hidden, *(layers or {}).values()]
        nbytes = [t.numel() * t.element_size() for t in tensors]
        need = sum(align_up(n) for n in nbytes)
        if need > slots.slot_size:
            raise SidecarError(f"hidden states of {need} bytes exceed the arena slot of {slots.slot_size}")
        refs, offset = [], slots.offset(slot)
        for tensor, n in zip(tensors, nbytes):
            refs.append(TensorRef(0, offset, n, list(tensor.shape), dtype_name(tensor.dtype)))
            offset += align_up(n)
        arena = self.arena
        on_host = arena.kind == "shm"
        if not on_host:
            arena.wait_done(slot)  # the sidecar's reads of this slot's previous use
        for tensor, ref in zip(tensors, refs):
            if on_host:
                arena_tensor(arena, ref).copy_(tensor)  # host staging (CPU, or accelerators without IPC)
            else:
                arena.tensor(ref).copy_(tensor, non_blocking=True)
        layer_refs = dict(zip((layers or {}).keys(), refs[1:]))
        return refs[0], layer_refs, (-1 if on_host else arena.mark_ready(slot))

    def sent(self, step: int) -> None:
        """`step`'s StepEnd is on its way: its slot is the sidecar's until that step's result."""
        slots = self._slots
        slots.owner_step[slots.slot_of(step)] = step


def read_plan(arena: Any, plan: StepPlan, input_batch: Any, model: Any,
              embeds: torch.Tensor | None) -> dict[str, Any]:
    """The plan's extra model inputs, copied out of the sidecar's arena.

    `embeds` is the persistent inputs_embeds buffer (already holding this
    step's token embeddings) when the runner feeds the model from one: overlay
    rows are written into it in place, so CUDA graphs see them.
    """
    if not (plan.extra_kwargs or plan.overlays):
        return {}
    on_device = arena is not None and arena.kind != "shm"
    if on_device and plan.event >= 0:
        arena.wait_ready(plan.event)  # the sidecar's writes, ordered on our stream
    extra: dict[str, Any] = {}
    if plan.extra_kwargs:
        device = model_device(model)
        extra = {k: _decode_kwarg(arena, v, device, 0) for k, v in plan.extra_kwargs.items()}
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


def _decode_kwarg(arena: Any, value: Any, device: torch.device, depth: int) -> Any:
    """Tensor markers become tensors (copied out of the arena onto the model's device)."""
    if depth > MAX_KWARG_DEPTH:
        raise SidecarError(f"sidecar extra kwargs nest deeper than {MAX_KWARG_DEPTH} levels")
    if isinstance(value, dict):
        if TENSOR_MARKER in value:
            if arena is None:
                raise SidecarError("sidecar sent tensor kwargs but offered no arena")
            ref = msgspec.convert(value[TENSOR_MARKER], TensorRef)
            return arena_tensor(arena, ref).to(device, copy=True)
        return {k: _decode_kwarg(arena, v, device, depth + 1) for k, v in value.items()}
    if isinstance(value, list):
        return [_decode_kwarg(arena, v, device, depth + 1) for v in value]
    return value


def model_device(model: Any) -> torch.device:
    for param in model.parameters():
        return param.device
    return torch.device("cpu")
