"""Same-shaped tensors of a plan stacked into one tensor each (protocol 1.7, issue #15).

With per-request state in the extra kwargs (vllm-omni's `runtime_additional_information`: one dict
per request, every step), a plan holds the same tensors for every request: each request's last
hidden row, its codes, its counters. One ref per tensor was a store, a ref, a check and a view
each, on both sides, once per request every step. Instead the sidecar stacks each set of tensors
of one dtype, shape and device into one tensor of the arena (`StepPlan.stacks`), and each place in
the trees names its row: `{ROW_MARKER: [k, i]}` is row i of stack k. The shim checks each stack's
ref once and makes all its rows in one call (worker_shim/transfer.py). A tensor alone of its kind
still travels as `{TENSOR_MARKER: ref}`, as do fewer than `MIN_ROWS` of a kind. Only for shims that read rows (1.7, STACKED_ROWS_MINOR).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from omni_arena.tensor_tree import mark_tree
from proto.messages import MAX_STACKS
from proto.tensors import ROW_MARKER, TENSOR_MARKER, TensorRef

# Fewer of a kind go one by one: a stack's fixed cost (~20 µs on the 2-core VM: the stack, its
# view, the grouping) outweighs what it saves below ~8 rows (bench/omni_step.py, 2 to 16 requests).
MIN_ROWS = 8


class RowStacker:
    """One tree's tensors, grouped by (dtype, shape, device) while it is marked, then placed."""

    def __init__(self) -> None:
        self._pending: list[tuple[dict, torch.Tensor]] = []

    def store(self, value: Any, put: Callable[[torch.Tensor], TensorRef],
              put_stack: Callable[[list[torch.Tensor]], int], stacks_used: int) -> Any:
        """`value` with its tensors in the arena: `put` for a tensor alone of its kind, `put_stack`
        (returns the stack's index in the plan) for each group; markers filled before it returns,
        so a tree that raises half way is never sent with markers left empty. `stacks_used`: the
        plan's stacks so far (the message holds at most MAX_STACKS; past it, tensors go alone)."""
        pending = self._pending
        try:
            tree = mark_tree(value, self._mark)
            groups: dict[tuple, list[tuple[dict, torch.Tensor]]] = {}
            for marker, tensor in pending:  # `is_cpu` before `device`: a device object costs more to make
                key = (tensor.dtype, tensor.shape, None if tensor.is_cpu else tensor.device)
                groups.setdefault(key, []).append((marker, tensor))
            for members in groups.values():
                if len(members) < MIN_ROWS or not members[0][1].numel() or stacks_used >= MAX_STACKS:
                    for marker, tensor in members:
                        marker[TENSOR_MARKER] = put(tensor)
                    continue
                k = put_stack([tensor for _, tensor in members])
                stacks_used += 1
                for i, (marker, _) in enumerate(members):
                    marker[ROW_MARKER] = [k, i]
            return tree
        finally:
            pending.clear()

    def _mark(self, tensor: torch.Tensor) -> dict:
        marker: dict = {}
        self._pending.append((marker, tensor))
        return marker
