"""The plan read before the forward: its tensors out of the sidecar's arena in one copy (`Region`), its
trees decoded with the shared decoder (omni_arena/tensor_tree.py, each tensor placed by msgspec), its
overlay rows into the step's embeds, and the buffers where a plan's extra kwargs land, their views
kept from step to step (`PlanLanding`).

Why the landing: the extra kwargs of a steady decode step (each request's state as vllm-omni's
`runtime_additional_information`) are the same stacks at the same places every step, only their
bytes change. Copied into a fresh tensor each step, every view would be made anew: the region's
allocation, a typed view per stack and a view per row (`unbind`: ~1 µs a row, 64 µs of a 212 µs
plan read at 64 requests on the H200 host). Landed in a buffer of ours, a stack placed where it
was last step keeps the views made then: a steady step makes no tensor (but an empty one for a
zero-byte stack).

Lifetime (docs/ARCHITECTURE.md, "Extra kwargs and CUDA graphs"): the tensors a step's kwargs hold are views of
buffer `n % BUFFERS` of plan n, rewritten by plan n + BUFFERS's read: they hold this step's values
through the next step, as vLLM's own model inputs (input_ids, positions) are views of buffers it
rewrites each step; a model that keeps one longer keeps a copy. On a device the rewrite is
enqueued on the shim's stream after the forwards that read them. Every other step hands out the
same tensor objects. What is kept is bounded (VIEWS_KEPT, ROWS_KEPT): a peer that moves its stacks
each step makes views each step but cannot make the kept ones grow.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from omni_arena.tensor_tree import TreeDecoder
from omni_arena.views import arena_tensor, check_arena_ref
from proto.arena import ALIGN, align_up
from proto.messages import ReqId, StepPlan
from proto.plan_trees import TreeError
from proto.tensors import DTYPE_ITEMSIZE, TensorRef
from worker_shim.errors import SidecarError

BUFFERS = 2  # a step's kwargs stay as they were through the next step (see Lifetime)
# What the views kept may hold: entries (a stack's view, or its rows' views), and row views in all
# (~600 bytes of host memory each). A steady step names the same few stacks of at most a batch's
# rows each; a peer that moves its stacks every step must not make the kept views grow with it.
VIEWS_KEPT = 256
ROWS_KEPT = 1 << 16

ViewKey = tuple[int, int, torch.dtype, tuple[int, ...], bool]  # buffer, byte offset, dtype, shape, as rows


class PlanLanding:
    """Buffers on the model's device for plans' kwargs bytes, used in turn, and the views made of them."""

    def __init__(self) -> None:
        self._buffers: list[torch.Tensor | None] = [None] * BUFFERS
        self._landed: list[torch.Tensor | None] = [None] * BUFFERS  # each buffer's last landed bytes
        self._source: tuple[Any, int, int, torch.Tensor] | None = None  # (arena, lo, hi, its bytes' view)
        self._turn = 0
        self.views: dict[ViewKey, Any] = {}  # a stack's view (or its rows' views), by where it lies
        self.rows_kept = 0  # row views in `views`
        self.landed = 0  # plans landed (tests: a steady step makes no view)
        self.views_made = 0

    def land(self, arena: Any, lo: int, hi: int, device: torch.device) -> tuple[int, torch.Tensor]:
        """The arena's bytes [lo, hi) (checked by the caller) copied into the next buffer: (its index,
        the bytes there)."""
        turn = self._turn
        self._turn = (turn + 1) % BUFFERS
        size = hi - lo
        buffer = self._buffers[turn]
        if buffer is None or buffer.numel() < size or buffer.device != device:
            # Grown by a quarter past the need, so a batch that grows a little does not re-make every view.
            buffer = self._buffers[turn] = torch.empty(align_up(size + size // 4), dtype=torch.uint8, device=device)
            self._landed[turn] = None
            for key in [key for key in self.views if key[0] == turn]:
                self._forget(key)
        # A steady step lands the same span of the same arena: its source and destination views are
        # the last step's (each a tensor op or three, ~12 % of the plan read on the H200 host).
        source = self._source
        if source is None or source[0] is not arena or source[1] != lo or source[2] != hi:
            source = self._source = (arena, lo, hi, arena_tensor(arena, TensorRef(0, lo, size, [size], "uint8")))
        landed = self._landed[turn]
        if landed is None or landed.numel() != size:
            landed = self._landed[turn] = buffer[:size]
        # A device arena's bytes are ordered on our stream (its ready event); a host arena's are read now.
        landed.copy_(source[3], non_blocking=arena.kind != "shm")
        self.landed += 1
        return turn, landed

    def view(self, key: ViewKey, make: Any) -> Any:
        """The view kept under `key`, else `make()`'s, kept while the bounds allow (all dropped when
        the new one would pass them; one larger than ROWS_KEPT alone is not kept)."""
        found = self.views.get(key)
        if found is not None:
            return found
        found = make()
        self.views_made += 1
        rows = len(found) if key[4] else 0
        if rows > ROWS_KEPT:
            return found
        if len(self.views) >= VIEWS_KEPT or self.rows_kept + rows > ROWS_KEPT:
            self.views.clear()
            self.rows_kept = 0
        self.views[key] = found
        self.rows_kept += rows
        return found

    def _forget(self, key: ViewKey) -> None:
        found = self.views.pop(key)
        if key[4]:
            self.rows_kept -= len(found)

    def close(self) -> None:
        self._buffers = [None] * BUFFERS
        self._landed = [None] * BUFFERS
        self._source = None  # first: its view keeps the arena's mapping alive
        self.views.clear()
        self.rows_kept = 0


class Region:
    """The bytes a set of refs spans, copied out of the arena in ONE copy; each ref a view of it (a
    copy per tensor was a launch each, once per request every step when per-request state rides in
    the extra kwargs). Every ref is checked (bounds, bytes, dtype, alignment) before the copy."""

    def __init__(self, arena: Any, refs: list[TensorRef], device: torch.device,
                 landing: PlanLanding | None = None) -> None:
        self.device = device
        self.dtypes = {id(ref): check_arena_ref(arena, ref) for ref in refs}
        sized = [ref for ref in refs if ref.nbytes]
        # From an ALIGN boundary (still inside the arena), so the copy's byte k is the arena's lo + k for
        # every dtype alike: a ref aligned to its dtype in the arena is aligned in the copy.
        self.lo = lo = min((r.offset for r in sized), default=0) // ALIGN * ALIGN
        hi = max((r.offset + r.nbytes for r in sized), default=0)
        self.copy = None
        self.landing, self.turn = landing, -1  # `landing`: the bytes land in its buffer, its views kept
        if sized and landing is not None:
            self.turn, self.copy = landing.land(arena, lo, hi, device)
        elif sized:
            self.copy = arena_tensor(arena, TensorRef(sized[0].arena, lo, hi - lo, [hi - lo], "uint8")).to(
                device, copy=True)
        self._typed: dict[torch.dtype, torch.Tensor] = {}  # the region's whole items of each dtype

    def view(self, ref: TensorRef) -> torch.Tensor:
        if self.landing is not None and ref.nbytes and self.copy is not None:
            return self.landing.view(self._key(ref, False), lambda: self._view(ref))
        return self._view(ref)

    def rows(self, ref: TensorRef, whole: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Every row's view of `ref` (a stack with rows and bytes), `whole` being its view."""
        if self.landing is not None and self.copy is not None:
            return self.landing.view(self._key(ref, True), lambda: whole.unbind(0))
        return whole.unbind(0)

    def _key(self, ref: TensorRef, rows: bool) -> ViewKey:
        """Where `ref` lies in the landing: the same bytes of the same buffer, the same view."""
        return self.turn, ref.offset - self.lo, self.dtypes[id(ref)], tuple(ref.shape), rows

    def _view(self, ref: TensorRef) -> torch.Tensor:
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


KWARGS = dict[str, Any]  # what a plan's extra kwargs decode as: keyword arguments
STATES = dict[ReqId, Any]  # its model states, by request


def kwargs_decoder(arena: Any, stacks: list[TensorRef], device: torch.device,
                   landing: PlanLanding | None) -> TreeDecoder:
    """The decoder of a plan's extra kwargs (views, on the model's device, every step): the span of
    all stacks in one copy (`Region`), landed in `landing`'s buffers when given, their views and
    rows kept from step to step."""
    region = Region(arena, stacks, device, landing)
    return TreeDecoder(len(stacks), lambda k: region.view(stacks[k]),
                       rows=lambda k, whole: region.rows(stacks[k], whole))


def states_decoder(arena: Any, stacks: list[TensorRef]) -> TreeDecoder:
    """The decoder of a plan's model states (host tensors of their own, kept for a request's
    lifetime; only when a model's hooks ask): each stack copied when first named, so the kwargs'
    bytes are not, the copies bounded by the bytes of the plan's stacks."""
    cpu = torch.device("cpu")
    return TreeDecoder(len(stacks), lambda k: Region(arena, [stacks[k]], cpu).view(stacks[k]), own=True,
                       copy_budget=sum(ref.nbytes for ref in stacks))


def decode_plan_tree(decoder: TreeDecoder, data: bytes, kind: Any) -> Any:
    """One of a plan's trees; SidecarError for one that cannot be read (a peer's tree is untrusted)."""
    try:
        return decoder.decode(data, kind)
    except TreeError as exc:
        raise SidecarError(f"sidecar sent a tree that cannot be read: {exc}") from None
    except RuntimeError as exc:  # a ref whose shape cannot be viewed
        raise SidecarError(f"sidecar sent a tensor ref that cannot be read: {exc}") from None


def read_states(arena: Any, plan: StepPlan) -> dict[str, Any]:
    """The plan's model states, as host copies (vllm-omni keeps decoded payloads on the host).

    Call before `read_plan`, which lets the sidecar reuse its arena once our copies ran."""
    if not plan.model_states:
        return {}
    if arena is not None and arena.kind != "shm" and plan.event >= 0:
        arena.wait_ready(plan.event)
    # Each state is kept for its request's lifetime (the model's state mirror): tensors of their own.
    _check_arena(arena, plan)
    states = decode_plan_tree(states_decoder(arena, plan.stacks), plan.model_states, STATES)
    bad = [r for r, v in states.items() if not isinstance(v, dict)]
    if bad:
        raise SidecarError(f"sidecar sent model states that are not dicts for {bad[:4]}")
    return states


def read_plan(arena: Any, plan: StepPlan, input_batch: Any, model: Any,
              embeds: torch.Tensor | None, landing: PlanLanding | None = None) -> dict[str, Any]:
    """The plan's extra model inputs, copied out of the sidecar's arena.

    `embeds` is the persistent inputs_embeds buffer (already holding this
    step's token embeddings) when the runner feeds the model from one: overlay
    rows are written into it in place, so CUDA graphs see them. `landing`: the
    plan's kwargs land in its buffers, their views kept from step to step; without
    it, in a copy of their own.
    """
    if not (plan.extra_kwargs or plan.overlays or plan.model_states):
        return {}
    on_device = arena is not None and arena.kind != "shm"
    if on_device and plan.event >= 0:
        arena.wait_ready(plan.event)  # the sidecar's writes, ordered on our stream
    extra: dict[str, Any] = {}
    if plan.extra_kwargs:
        _check_arena(arena, plan)
        decoder = kwargs_decoder(arena, plan.stacks, model_device(model), landing)
        extra = decode_plan_tree(decoder, plan.extra_kwargs, KWARGS)
    if plan.overlays:
        extra["inputs_embeds"] = _overlay(arena, plan, input_batch, model, embeds)
    if on_device:
        arena.mark_done(0)  # the sidecar may rewrite its arena once our copies ran
    return extra


def _check_arena(arena: Any, plan: StepPlan) -> None:
    if plan.stacks and arena is None:
        raise SidecarError("sidecar sent tensors but offered no arena")


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
