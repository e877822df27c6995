"""Trees with tensors in both directions: the one encoder and the one decoder of proto/plan_trees.py's form.

A tree (a plan's extra kwargs and model states, a step's model updates and outputs, a mirrored
append) travels as msgpack bytes; each tensor in it is an extension value naming a stack of the
list its message carries beside it (StepPlan.stacks, StepEnd.tensors: refs into an arena;
MirrorUpdate.blobs: bytes inline). `TreeEncoder` marks each tensor as msgspec's encoder meets it
and hands the stacks to the caller's `put`s; `TreeDecoder` decodes with an `ext_hook` that returns
the tensor itself, so msgspec puts every tensor in place as it builds the containers. Neither side
walks a tree in Python (the walk and the grouping after it were half of a plan's build at 64
requests, and most of the shim's plan read). A received tree is untrusted: every mark is checked
against the stacks the message has, and what a tree can make is bounded by its size.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import msgspec
import torch

from omni_arena.views import tensor_from_bytes, tensor_to_bytes
from proto.messages import TensorBlob
from proto.plan_trees import ROW_MARK, ROW_MARK_WIRE_BYTES, STACK_ROW, TreeError, read_mark, row_mark, whole_mark
from proto.tensors import MAX_TENSOR_DIMS

Tree = dict[str, Any]  # a tree's root: keyword arguments, {req_id: state}, an append's entries


class TreeEncoder:
    """Every tensor of a tree as a row of one of the message's stacks (or, when a stack cannot hold
    it, a stack used whole), its place in the tree an extension value.

    msgspec's encoder walks the tree and calls `_mark` for each tensor it meets. A tensor's kind
    (dtype, shape, device) takes the next stack index the first time it is met, so each mark is
    final when written; the stacks are put after the walk, in index order. A kind met once is a
    stack of one row (its put costs what a put of the tensor would)."""

    def __init__(self) -> None:
        self._encoder = msgspec.msgpack.Encoder(enc_hook=self._mark)
        self._kinds: dict[tuple, tuple[int, list[torch.Tensor]]] = {}  # (its stack's index, its rows)
        self._stacks: list[list[torch.Tensor] | torch.Tensor] = []  # a kind's rows, or a tensor used whole
        self._first = 0

    def encode(self, value: Tree, put_whole: Callable[[torch.Tensor], int],
               put_stack: Callable[[list[torch.Tensor]], int], first: int = 0) -> bytes:
        """`value` as a tree's bytes (b"" for an empty one), its tensors put: `put_stack` for each
        kind's rows, `put_whole` for a tensor no stack can hold (empty, or a stack would pass
        MAX_TENSOR_DIMS); both return the stack's index in the message, `first` for this tree's
        first. A value msgpack cannot carry raises TypeError; the puts' errors pass through."""
        if not value:
            return b""
        self._first = first
        try:
            data = self._encoder.encode(value)
            for k, stack in enumerate(self._stacks, first):
                placed = put_stack(stack) if type(stack) is list else put_whole(stack)
                if placed != k:  # the marks name k: a put elsewhere would send every tensor wrong
                    raise RuntimeError(f"stack {k} of a message was put at {placed}")
            return data
        finally:
            self._kinds.clear()
            self._stacks.clear()

    def unfit(self, value: dict[Any, Tree]) -> dict[Any, str]:
        """The entries of `value` whose tree msgpack cannot carry (`encode`'s TypeError), each walked
        alone and nothing put, with why."""
        out = {}
        for key, tree in value.items():
            try:
                self._encoder.encode(tree)
            except TypeError as exc:
                out[key] = str(exc)
            finally:
                self._kinds.clear()
                self._stacks.clear()
        return out

    def _mark(self, tensor: Any) -> msgspec.msgpack.Ext:
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"a tree cannot hold a {type(tensor).__name__}")
        key = (tensor.dtype, tensor.shape, None if tensor.is_cpu else tensor.device)  # `is_cpu` first: cheaper
        kind = self._kinds.get(key)
        if kind is None:
            stack = self._first + len(self._stacks)
            if tensor.dim() > MAX_TENSOR_DIMS:  # the receiver would refuse the whole message
                raise TypeError(f"a tree's tensor has {tensor.dim()} dimensions, more than {MAX_TENSOR_DIMS}")
            if not tensor.numel() or tensor.dim() == MAX_TENSOR_DIMS:
                self._stacks.append(tensor)
                return whole_mark(stack)
            kind = self._kinds[key] = (stack, [])
            self._stacks.append(kind[1])
        stack, rows = kind
        rows.append(tensor)
        return row_mark(stack, len(rows) - 1)


Rows = Callable[[int, torch.Tensor], Sequence[torch.Tensor]]


class TreeDecoder:
    """Trees whose marks name `count` stacks, each tensor placed by msgspec's decoder as it is met.

    `whole(k)` is stack k (k < count, checked here; the caller checked its ref or blob). `rows(k,
    whole)` its rows' views (default `whole.unbind(0)`; the shim keeps them from step to step).
    `own`: every tensor a copy of its own (trees kept past the step: per-request states, a
    mirror's entries), the bytes copied bounded by `copy_budget` (the bytes of the stacks: each is
    named once by an honest sender).

    A peer's tree is untrusted, and a mark is a few bytes: a stack's rows are made in one call only
    while the tree still has room to name them all (a budget shared by all its stacks: aliased
    stacks cannot multiply it), else indexed per mark."""

    def __init__(self, count: int, whole: Callable[[int], torch.Tensor], own: bool = False,
                 copy_budget: int = 0, rows: Rows | None = None) -> None:
        self.count, self.whole, self.own, self.rows_view = count, whole, own, rows
        self.rows: dict[int, Any] = {}  # a stack's rows (a tuple of views, or the stack to index)
        self.wholes: dict[int, torch.Tensor] = {}
        self.rows_left = 0  # rows the tree being decoded can still name (ROW_MARK_WIRE_BYTES each)
        self.copy_bytes_left = copy_budget

    def decode(self, data: bytes, kind: Any = Tree) -> Any:
        """The tree `data` holds (b"": an empty dict); TreeError for one that cannot be read."""
        if not data:
            return {}
        self.rows_left = len(data) // ROW_MARK_WIRE_BYTES
        try:
            return msgspec.msgpack.Decoder(kind, ext_hook=self._hook()).decode(data)
        except msgspec.DecodeError as exc:
            raise TreeError(f"malformed tree: {exc}") from None
        except RuntimeError as exc:  # a recursion past msgspec's guard; a stack whose shape cannot be viewed
            raise TreeError(f"a tree that cannot be read: {exc}") from None

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
                    raise TreeError(f"a tree names row {i} of stack {k}, which has {len(rows)}")
                return owned(rows[i]) if own else rows[i]
            k, _ = read_mark(code, data)  # a whole stack, or an extension value that is none of ours
            return owned(whole_of(k)) if own else whole_of(k)

        return tensor

    def _whole_of(self, k: int) -> torch.Tensor:
        if k >= self.count:
            raise TreeError(f"a tree names stack {k} of a message with {self.count}")
        found = self.wholes.get(k)
        if found is None:
            found = self.wholes[k] = self.whole(k)
        return found

    def _rows_of(self, k: int) -> Any:
        whole = self._whole_of(k)
        if not whole.dim() or not whole.numel():  # a sender never stacks empty tensors
            raise TreeError(f"a tree names a row of stack {k}, which has no rows or bytes")
        count = whole.shape[0]
        if count <= self.rows_left:  # every row's view in one call
            self.rows_left -= count
            rows = self.rows[k] = whole.unbind(0) if self.rows_view is None else self.rows_view(k, whole)
        else:
            rows = self.rows[k] = whole
        return rows

    def _owned(self, tensor: torch.Tensor) -> torch.Tensor:
        self.copy_bytes_left -= tensor.nbytes
        if self.copy_bytes_left < 0:
            raise TreeError("a tree names more bytes than its message's stacks hold")
        return tensor.clone()


# -- trees whose tensors travel inline (MirrorUpdate: a control message, rare) ---------------------


def encode_inline(value: Tree) -> tuple[bytes, list[TensorBlob]]:
    """A tree's bytes and its stacks as blobs in the message itself."""
    blobs: list[TensorBlob] = []

    def put(tensor: torch.Tensor) -> int:
        data, shape, dtype = tensor_to_bytes(tensor)
        blobs.append(TensorBlob(shape, dtype, data))
        return len(blobs) - 1

    return TreeEncoder().encode(value, put, lambda rows: put(torch.stack(rows))), blobs


def decode_inline(data: bytes, blobs: list[TensorBlob]) -> Tree:
    """`encode_inline`'s inverse for an untrusted message, each tensor its own: TreeError on a
    malformed tree or blob."""
    def whole(k: int) -> torch.Tensor:
        blob = blobs[k]
        try:
            return tensor_from_bytes(blob.data, list(blob.shape), blob.dtype)
        except (KeyError, ValueError, RuntimeError) as exc:
            raise TreeError(f"bad inline tensor: {exc}") from None

    return TreeDecoder(len(blobs), whole, own=True, copy_budget=sum(len(b.data) for b in blobs)).decode(data)
