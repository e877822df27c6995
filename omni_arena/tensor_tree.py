"""Nested JSON-like values with tensors inside, in both directions across an arena.

A tensor travels as `{TENSOR_MARKER: TensorRef}` (or, in a plan, as a row of one of its
stacked tensors: `{ROW_MARKER: [k, i]}`, `RowStacker` below); dicts (any key type: vllm-omni keys
`hidden_states.layers` by int), lists and tuples nest up to `MAX_TREE_DEPTH` levels. A 1.8 plan's
trees (`ExtStacker`) are msgpack bytes with extension values instead, walked by msgspec on both
sides: their nesting is bounded by its recursion guard, not checked against `MAX_TREE_DEPTH`.
Both sides use these two walkers (extra kwargs, model states, model updates and
outputs), so the encoding is written once. A received tree is untrusted: its refs
are converted by the caller's `load`, which bounds-checks them against its arena.
"""

from __future__ import annotations

from typing import Any, Callable

import msgspec
import torch

from omni_arena.views import tensor_from_bytes, tensor_to_bytes
from proto.messages import MAX_STACKS, TensorBlob
from proto.plan_trees import row_mark, whole_mark
from proto.tensors import MAX_TENSOR_DIMS, ROW_MARKER, TENSOR_MARKER, TensorRef

MAX_TREE_DEPTH = 8


class TreeError(ValueError):
    """A tree nests too deep or holds a malformed tensor marker."""


_SCALARS = frozenset({int, float, str, bool, bytes, type(None)})
_TENSOR = torch.Tensor  # exactly: subclasses (Parameter) take `isinstance`


def store_tree(value: Any, put: Callable[[torch.Tensor], TensorRef]) -> Any:
    """Tensors become markers holding the ref `put` returns (the tensor copied into an arena)."""
    return mark_tree(value, lambda tensor: {TENSOR_MARKER: put(tensor)})


def mark_tree(value: Any, mark: Callable[[torch.Tensor], dict], depth: int = 0) -> Any:
    """Tensors become the marker dicts `mark` makes (`store_tree`'s, or a stacker's to fill later)."""
    # Exact types first: per-request state every step is mostly plain dicts, lists and scalars, and
    # `isinstance(x, torch.Tensor)` costs ten times `type(x) is dict` for a value that is not one.
    kind = type(value)
    if kind is dict or kind is list or kind is tuple:
        if value and depth + 1 > MAX_TREE_DEPTH:  # its items would be deeper: the receiver's rule (`_index`)
            raise TreeError(f"value nests deeper than {MAX_TREE_DEPTH} levels")
        # Loops, not comprehensions, and a plain tensor marked here: a call less per tensor (a plan
        # holds one per request), a third less time for the walk.
        inner = depth + 1
        if kind is dict:
            marked: dict = {}
            for k, v in value.items():
                t = type(v)
                marked[k] = v if t in _SCALARS else mark(v) if t is _TENSOR else mark_tree(v, mark, inner)
            return marked
        items = []
        for v in value:
            t = type(v)
            items.append(v if t in _SCALARS else mark(v) if t is _TENSOR else mark_tree(v, mark, inner))
        return items
    if kind in _SCALARS:
        return value
    if isinstance(value, torch.Tensor):
        return mark(value)
    if isinstance(value, dict):  # subclasses (OrderedDict, defaultdict): as a dict
        return mark_tree(dict(value), mark, depth)
    if isinstance(value, (list, tuple)):
        return mark_tree(list(value), mark, depth)
    return value


def load_tree(value: Any, load: Callable[[Any], torch.Tensor], ref_type: type = TensorRef) -> Any:
    """Markers become the tensors `load` makes of their refs (a copy out of the arena; `ref_type`
    TensorBlob: a tensor sent inline, see `inline_tree`). The whole tree is checked before the
    first `load`."""
    root, places = index_tree(value, ref_type)
    for holder, key, ref in places:
        holder[key] = load(ref)
    return root[0]


Place = tuple[Any, Any, Any]  # (the dict or list holding a tensor, its key or index, its ref)
RowPlace = tuple[Any, Any, int, int]  # (holder, key, stack index, row): not yet checked against the plan


def index_tree(value: Any, ref_type: type = TensorRef) -> tuple[list[Any], list[Place]]:
    """Where each tensor of a received tree goes, in tree order: a caller that checks every ref
    before it makes any tensor (one copy for all of them) then puts each in place, without a second
    walk. The tree is the received message's own: its containers are filled in place, never
    copied (a copy of every dict and list was most of the walk's time; a decoded message shares no
    container with anything). It comes back as the one item of a list (a tree that is itself a
    tensor has a holder too). TreeError when it nests deeper than `MAX_TREE_DEPTH` or holds a
    malformed marker (a row marker included: only plans carry stacks)."""
    return index_trees([value], ref_type)


def index_trees(values: list[Any], ref_type: type = TensorRef,
                rows: list[RowPlace] | None = None) -> tuple[list[Any], list[Place]]:
    """`index_tree` of several trees at once (each at depth 0, as if alone): the list of them. With
    `rows`, a plan's row markers (`RowStacker`) are gathered there; without, one is an error."""
    places: list[Place] = []
    _index(values, places, rows, -1, ref_type)
    return values, places


def _index(value: dict | list, places: list[Place], rows: list[RowPlace] | None, depth: int, ref_type: type) -> None:
    if value and depth + 1 > MAX_TREE_DEPTH:
        raise TreeError(f"value nests deeper than {MAX_TREE_DEPTH} levels")
    for key, v in value.items() if type(value) is dict else enumerate(value):
        kind = type(v)
        if kind is dict:
            if TENSOR_MARKER in v:
                try:
                    places.append((value, key, msgspec.convert(v[TENSOR_MARKER], ref_type)))
                except msgspec.ValidationError as exc:
                    raise TreeError(f"malformed tensor ref: {exc}") from None
            elif ROW_MARKER in v:
                row = v[ROW_MARKER]
                if rows is None:
                    raise TreeError("a row marker where only tensor refs may be")
                if not (type(row) is list and len(row) == 2 and type(row[0]) is int and type(row[1]) is int
                        and row[0] >= 0 and row[1] >= 0):
                    raise TreeError(f"malformed row marker {row!r:.80}: want [stack index, row]")
                rows.append((value, key, row[0], row[1]))
            else:
                _index(v, places, rows, depth + 1, ref_type)
        elif kind is list:
            _index(v, places, rows, depth + 1, ref_type)


def inline_tree(value: Any) -> Any:
    """Tensors as `{TENSOR_MARKER: TensorBlob}`: bytes in the message itself (MirrorUpdate)."""
    def blob(tensor: torch.Tensor) -> Any:
        data, shape, dtype = tensor_to_bytes(tensor)
        return TensorBlob(shape, dtype, data)

    return store_tree(value, blob)


def load_inline_tree(value: Any) -> Any:
    """`inline_tree`'s inverse for an untrusted message: TreeError on a malformed tensor."""
    def tensor(blob: TensorBlob) -> torch.Tensor:
        try:
            return tensor_from_bytes(blob.data, list(blob.shape), blob.dtype)
        except (KeyError, ValueError, RuntimeError) as exc:
            raise TreeError(f"bad inline tensor: {exc}") from None

    return load_tree(value, tensor, ref_type=TensorBlob)


# -- a plan's same-shaped tensors as one stack each (protocol 1.7, issue #15) ---------------------
# With per-request state in the extra kwargs (vllm-omni's `runtime_additional_information`: one dict
# per request, every step) a plan holds the same tensors for every request: each one's last hidden
# row, codes, counters. A ref each was a store, a ref, a check and a view, on both sides, per request
# every step. So the sidecar stacks each set of one dtype, shape and device into one tensor of the
# arena (`StepPlan.stacks`), and each place names its row: `{ROW_MARKER: [k, i]}` is row i of stack
# k; the shim checks each stack once and makes its rows in one call (worker_shim/plan_read.py). Only
# for shims of 1.7 (STACKED_ROWS_MINOR).

# 1.7: fewer of a kind go one by one: a stack's fixed cost (~20 µs on the 2-core VM: the stack, its
# view, the grouping) outweighs what it saves below ~8 rows (bench/omni_step.py, 2 to 16 requests).
MIN_ROWS = 8


class RowStacker:
    """1.7: `{TENSOR_MARKER: ref}` for a tensor alone of its kind, `{ROW_MARKER: [k, i]}` for a row
    of a stack: the tree's tensors marked as it is walked, then grouped by (dtype, shape, device)."""

    def __init__(self) -> None:
        self._pending: list[tuple[Any, torch.Tensor]] = []

    def _groups(self) -> Any:
        groups: dict[tuple, list[tuple[Any, torch.Tensor]]] = {}
        for marker, tensor in self._pending:  # `is_cpu` before `device`: a device object costs more to make
            key = (tensor.dtype, tensor.shape, None if tensor.is_cpu else tensor.device)
            groups.setdefault(key, []).append((marker, tensor))
        return groups.values()

    def store(self, value: Any, put: Callable[[torch.Tensor], TensorRef],
              put_stack: Callable[[list[torch.Tensor]], int], stacks_used: int) -> Any:
        """`value` with its tensors in the arena: `put` for a tensor alone of its kind, `put_stack`
        (returns the stack's index in the plan) for each group; markers filled before it returns,
        so a tree that raises half way is never sent with markers left empty. `stacks_used`: the
        plan's stacks so far (the message holds at most MAX_STACKS; past it, tensors go alone)."""
        try:
            tree = mark_tree(value, self._mark)
            for members in self._groups():
                if _alone(members) or stacks_used >= MAX_STACKS:
                    for marker, tensor in members:
                        marker[TENSOR_MARKER] = put(tensor)
                    continue
                k = put_stack([tensor for _, tensor in members])
                stacks_used += 1
                for i, (marker, _) in enumerate(members):
                    marker[ROW_MARKER] = [k, i]
            return tree
        finally:
            self._pending.clear()

    def _mark(self, tensor: torch.Tensor) -> dict:
        marker: dict = {}
        self._pending.append((marker, tensor))
        return marker


class ExtStacker:
    """1.8 (proto/plan_trees.py): every tensor of the plan is a row of one of its `stacks` (or, when
    a stack cannot hold it, a stack used whole), its place in the tree an extension value.

    msgspec's encoder walks the tree (no Python walk on this side either: the walk and the grouping
    after it were half of a plan's build at 64 requests) and calls `_mark` for each tensor it meets.
    A tensor's kind (dtype, shape, device) takes the next stack index the first time it is met, so
    each mark is final when written; the stacks are made after the walk, in index order. A kind
    met once is a stack of one row (its put costs what a put of the tensor would)."""

    def __init__(self) -> None:
        self._encoder = msgspec.msgpack.Encoder(enc_hook=self._mark)
        self._kinds: dict[tuple, tuple[int, list[torch.Tensor]]] = {}  # (its stack's index, its rows)
        self._stacks: list[list[torch.Tensor] | torch.Tensor] = []  # a kind's rows, or a tensor used whole
        self._first = 0

    def store(self, value: Any, put_whole: Callable[[torch.Tensor], int],
              put_stack: Callable[[list[torch.Tensor]], int], first: int) -> bytes:
        """`value` as a 1.8 tree's bytes, its tensors in the arena: `put_stack` for each kind's rows,
        `put_whole` for a tensor no stack can hold (empty, or a stack would pass MAX_TENSOR_DIMS);
        both return the stack's index in the plan, `first` for this tree's first. A value msgpack
        cannot carry raises TypeError; an arena too small, ArenaError."""
        self._first = first
        try:
            data = self._encoder.encode(value)
            for k, stack in enumerate(self._stacks, first):
                placed = put_stack(stack) if type(stack) is list else put_whole(stack)
                if placed != k:  # the marks name k: a put elsewhere would send every tensor wrong
                    raise RuntimeError(f"stack {k} of a plan was put at {placed}")
            return data
        finally:
            self._kinds.clear()
            self._stacks.clear()

    def _mark(self, tensor: Any) -> msgspec.msgpack.Ext:
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"a plan's tree cannot hold a {type(tensor).__name__}")
        key = (tensor.dtype, tensor.shape, None if tensor.is_cpu else tensor.device)  # `is_cpu` first: cheaper
        kind = self._kinds.get(key)
        if kind is None:
            stack = self._first + len(self._stacks)
            if tensor.dim() > MAX_TENSOR_DIMS:  # the shim would refuse the whole plan: this request's error
                raise TypeError(f"a plan's tensor has {tensor.dim()} dimensions, more than {MAX_TENSOR_DIMS}")
            if not tensor.numel() or tensor.dim() == MAX_TENSOR_DIMS:
                self._stacks.append(tensor)
                return whole_mark(stack)
            kind = self._kinds[key] = (stack, [])
            self._stacks.append(kind[1])
        stack, rows = kind
        rows.append(tensor)
        return row_mark(stack, len(rows) - 1)


def _alone(members: list[tuple[Any, torch.Tensor]]) -> bool:
    """Few of a kind, empty ones, and ones a stack's extra dimension would take past the wire's
    MAX_TENSOR_DIMS go alone."""
    first = members[0][1]
    return len(members) < MIN_ROWS or not first.numel() or first.dim() >= MAX_TENSOR_DIMS
