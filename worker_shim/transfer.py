"""Tensors across the arenas: a step's hidden states and model results into our hidden slots,
the plan's tensors out of the sidecar's arena.

Host arenas (`kind == "shm"`) are plain memory; device arenas (`"cuda_ipc"`)
order their reads and writes with events: a slot is rewritten only after the
sidecar's done event for its previous use, and the sidecar's arena is read
only after its ready event (docs/ARCHITECTURE.md, "Arena slots").
"""

from __future__ import annotations

import weakref
from typing import Any, Callable

import msgspec
import torch

from omni_arena.tensor_tree import RowPlace, TreeError, index_trees
from omni_arena.views import arena_tensor, check_arena_ref, dtype_name
from proto.arena import ALIGN, SlotRing, align_up
from proto.messages import ReqId, StepPlan
from proto.plan_trees import ROW_MARK, ROW_MARK_WIRE_BYTES, STACK_ROW, PlanTreeError, read_mark
from proto.tensors import DTYPE_ITEMSIZE, TensorRef
from worker_shim.channel import SidecarError


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
        ref = slot.put(hidden, steady=True)
        layer_refs = slot.put_layers(layers)
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
        if self.offset + nbytes > self.end:
            raise SidecarError(
                f"step data of {self.offset - self.start + nbytes} bytes exceed the arena slot of "
                f"{self.end - self.start} (raise omni_sidecar model_io_mib)"
            )
        shape = tensor.shape
        ref = TensorRef(0, self.offset, nbytes, list(shape), dtype_name(tensor.dtype))
        if nbytes:
            views, key = self._views, (self.offset, tensor.dtype, shape)
            dst = views.get(key) if steady else None
            if dst is None:
                dst = arena_tensor(self.arena, ref)  # bounds-checked, typed, shaped
                if steady:
                    if len(views) >= VIEWS_KEPT:  # prefill shapes vary: bounded, steady decode refills it
                        views.clear()
                    views[key] = dst
            if self.arena.kind == "shm":
                dst.copy_(tensor.detach())  # host staging
            else:
                dst.copy_(tensor.detach(), non_blocking=True)
        self.offset = align_up(self.offset + max(nbytes, 1))
        self._refs[id(tensor)] = (tensor, ref)
        return ref

    def put_layers(self, layers: dict[int, torch.Tensor] | None) -> dict[int, TensorRef]:
        """Captured layers' rows (HookNeeds.hidden_layers), after the hidden rows."""
        return {n: self.put(rows, steady=True) for n, rows in (layers or {}).items()}

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
        states = _StackReader(arena, plan.stacks, cpu, own=True).decode(plan.model_states, _STATES)
    else:
        states = dict(zip(plan.model_states, _copy_out_trees(arena, list(plan.model_states.values()), cpu,
                                                             plan.stacks, own=True)))
    bad = [r for r, v in states.items() if not isinstance(v, dict)]
    if bad:
        raise SidecarError(f"sidecar sent model states that are not dicts for {bad[:4]}")
    return states


def read_plan(arena: Any, plan: StepPlan, input_batch: Any, model: Any,
              embeds: torch.Tensor | None) -> dict[str, Any]:
    """The plan's extra model inputs, copied out of the sidecar's arena.

    `embeds` is the persistent inputs_embeds buffer (already holding this
    step's token embeddings) when the runner feeds the model from one: overlay
    rows are written into it in place, so CUDA graphs see them.
    """
    if not (plan.extra_kwargs or plan.overlays or plan.model_states):
        return {}
    on_device = arena is not None and arena.kind != "shm"
    if on_device and plan.event >= 0:
        arena.wait_ready(plan.event)  # the sidecar's writes, ordered on our stream
    extra: dict[str, Any] = {}
    if type(plan.extra_kwargs) is bytes:
        extra = _StackReader(arena, plan.stacks, model_device(model), own=False).decode(plan.extra_kwargs, _KWARGS)
    elif plan.extra_kwargs:
        device = model_device(model)
        extra = _copy_out_trees(arena, [plan.extra_kwargs], device, plan.stacks)[0]
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


class _Region:
    """The bytes a set of refs spans, copied out of the arena in ONE copy; each ref a view of it (a
    copy per tensor was a launch each, once per request every step when per-request state rides in
    the extra kwargs). Every ref is checked (bounds, bytes, dtype, alignment) before the copy."""

    def __init__(self, arena: Any, refs: list[TensorRef], device: torch.device) -> None:
        self.device = device
        self.dtypes = {id(ref): check_arena_ref(arena, ref) for ref in refs}
        sized = [ref for ref in refs if ref.nbytes]
        # From an ALIGN boundary (still inside the arena), so the copy's byte k is the arena's lo + k for
        # every dtype alike: a ref aligned to its dtype in the arena is aligned in the copy.
        self.lo = lo = min((r.offset for r in sized), default=0) // ALIGN * ALIGN
        hi = max((r.offset + r.nbytes for r in sized), default=0)
        self.copy = None
        if sized:
            self.copy = arena_tensor(arena, TensorRef(sized[0].arena, lo, hi - lo, [hi - lo], "uint8")).to(
                device, copy=True)
        self._typed: dict[torch.dtype, torch.Tensor] = {}  # the region's whole items of each dtype

    def view(self, ref: TensorRef) -> torch.Tensor:
        dtype = self.dtypes[id(ref)]
        region = self.copy
        if not ref.nbytes or region is None:
            return torch.empty(ref.shape, dtype=dtype, device=self.device)
        size = DTYPE_ITEMSIZE[ref.dtype]
        items = self._typed.get(dtype)
        if items is None:
            items = self._typed[dtype] = region[: region.numel() // size * size].view(dtype)
        start = (ref.offset - self.lo) // size
        return items[start : start + ref.nbytes // size].view(ref.shape)


_KWARGS = dict[str, Any]  # what a 1.8 plan's extra kwargs decode as: keyword arguments
_STATES = dict[ReqId, Any]  # its model states, by request


class _StackReader:
    """A 1.8 plan's stacks out of the arena and a decoder hook that turns each tensor mark of a tree
    (proto/plan_trees.py) into its tensor: msgspec's decoder calls the hook for every mark and places
    what it returns, so no Python walks the tree.

    Extra kwargs (views, on the model's device, every step): the span of all stacks in one copy.
    Model states (`own`: host tensors of their own, kept for a request's lifetime; only when a
    model's hooks ask): each stack copied when first named, so the kwargs' bytes are not.

    A peer's tree is untrusted, and a mark is a few bytes: what a tree makes is bounded by its size.
    A stack's rows are made in one call only while the tree still has room to name them all (a
    budget shared by all its stacks: aliased stacks cannot multiply it), else indexed per mark;
    copies (`own`) are bounded by the bytes of the plan's stacks, each of which a sidecar names once."""

    def __init__(self, arena: Any, stacks: list[TensorRef], device: torch.device, own: bool) -> None:
        if stacks and arena is None:
            raise SidecarError("sidecar sent tensors but offered no arena")
        self.arena, self.stacks, self.device, self.own = arena, stacks, device, own
        self.region = _Region(arena, stacks, device) if stacks and not own else None
        self.copies: dict[int, torch.Tensor] = {}  # own: stack k, copied out when first named
        self.rows: dict[int, Any] = {}  # a stack's rows (a tuple of views, or the stack to index)
        self.rows_left = 0  # rows the tree being decoded can still name (ROW_MARK_WIRE_BYTES each)
        self.copy_bytes_left = sum(ref.nbytes for ref in stacks) if own else 0

    def decode(self, data: bytes, kind: Any) -> Any:
        self.rows_left = len(data) // ROW_MARK_WIRE_BYTES
        try:
            return msgspec.msgpack.Decoder(kind, ext_hook=self._hook()).decode(data)
        except (msgspec.DecodeError, PlanTreeError) as exc:
            raise SidecarError(f"sidecar sent a malformed tree: {exc}") from None
        except RuntimeError as exc:  # a recursion past msgspec's guard; a ref whose shape cannot be viewed
            raise SidecarError(f"sidecar sent a tree that cannot be read: {exc}") from None

    def _hook(self) -> Callable[[int, memoryview], torch.Tensor]:
        """The decoder's `ext_hook`: a closure over locals, called once per tensor of the tree (per
        request, every step), so its every-request path is a few local look-ups."""
        rows_made, rows_of, unpack, own, mark_size = self.rows, self._rows_of, ROW_MARK.unpack, self.own, ROW_MARK.size
        whole_of, owned = self._whole_of, self._owned

        def tensor(code: int, data: memoryview) -> torch.Tensor:
            if code == STACK_ROW and len(data) == mark_size:  # the every-request case first
                k, i = unpack(data)
                rows = rows_made.get(k)
                if rows is None:
                    rows = rows_of(k)
                if i >= len(rows):
                    raise PlanTreeError(f"a tree names row {i} of stack {k}, which has {len(rows)}")
                return owned(rows[i]) if own else rows[i]
            k, _ = read_mark(code, data)  # a whole stack, or an extension value that is none of ours
            return owned(whole_of(k)) if own else whole_of(k)

        return tensor

    def _whole_of(self, k: int) -> torch.Tensor:
        if k >= len(self.stacks):
            raise PlanTreeError(f"a tree names stack {k} of a plan with {len(self.stacks)}")
        if self.region is not None:
            return self.region.view(self.stacks[k])
        copy = self.copies.get(k)
        if copy is None:
            copy = self.copies[k] = _Region(self.arena, [self.stacks[k]], self.device).view(self.stacks[k])
        return copy

    def _rows_of(self, k: int) -> Any:
        if k < len(self.stacks) and not (self.stacks[k].shape and self.stacks[k].nbytes):
            raise PlanTreeError(f"a tree names a row of stack {k}, which has no rows or bytes")  # none stacked empty
        whole = self._whole_of(k)  # checks k, copies an `own` stack out
        count = self.stacks[k].shape[0]
        if count <= self.rows_left:  # every row's view in one call
            self.rows_left -= count
            rows = self.rows[k] = whole.unbind(0)
        else:
            rows = self.rows[k] = whole
        return rows

    def _owned(self, tensor: torch.Tensor) -> torch.Tensor:
        self.copy_bytes_left -= tensor.nbytes
        if self.copy_bytes_left < 0:
            raise PlanTreeError("a tree names more bytes than the plan's stacks hold")
        return tensor.clone()


def _copy_out_trees(arena: Any, trees: list[Any], device: torch.device, stacks: list[TensorRef],
                    own: bool = False) -> list[Any]:
    """Received trees' tensors (1.7 and before: marker dicts found by a walk), copied out of the
    arena in one copy (`_Region`), then views of that copy. Rows of the plan's `stacks` (1.7) are
    made per stack in one call (omni_arena/tensor_tree.py, RowStacker). Every ref, stack and row is
    checked before anything is copied. `own`: each tensor in storage of its own (trees kept past the
    step, e.g. per-request states, must not keep the others' bytes alive)."""
    row_places: list[RowPlace] = []
    try:
        root, places = index_trees(trees, rows=row_places)
    except TreeError as exc:
        raise SidecarError(f"sidecar sent a malformed tree: {exc}") from None
    if not places and not row_places:
        return root
    if arena is None:
        raise SidecarError("sidecar sent tensors but offered no arena")
    named = _check_rows(row_places, stacks)
    region = _Region(arena, [ref for _, _, ref in places] + [stacks[k] for k in named], device)
    view = region.view
    try:
        rows: dict[int, Any] = {}
        for k, count in named.items():
            whole = view(stacks[k])
            # Every row's view in one call, when the rows named are all of them (the sidecar names
            # each row once); a stack with more rows than named is indexed row by row instead.
            rows[k] = whole.unbind(0) if whole.shape[0] <= count else whole
        for holder, key, k, i in row_places:
            holder[key] = rows[k][i].clone() if own else rows[k][i]
        for holder, key, ref in places:
            holder[key] = view(ref).clone() if own else view(ref)
    except RuntimeError as exc:  # e.g. a zero-byte ref whose shape overflows: the peer's bad ref
        raise SidecarError(f"sidecar sent a tensor ref that cannot be read: {exc}") from None
    return root


def _check_rows(row_places: list[RowPlace], stacks: list[TensorRef]) -> dict[int, int]:
    """The stacks the row markers name, with how many markers name each; SidecarError for a stack
    the plan lacks, one with no rows or no bytes (a sidecar never stacks empty tensors), or a row
    past a stack's end."""
    named: dict[int, int] = {}
    for _, _, k, i in row_places:
        if k >= len(stacks):
            raise SidecarError(f"sidecar named stack {k} of a plan with {len(stacks)}")
        shape = stacks[k].shape
        if not shape or not stacks[k].nbytes:
            raise SidecarError(f"sidecar sent stack {k} without rows or bytes (shape {shape})")
        if i >= shape[0]:
            raise SidecarError(f"sidecar named row {i} of stack {k}, which has {shape[0]}")
        named[k] = named.get(k, 0) + 1
    return named


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
