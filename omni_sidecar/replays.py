"""Rows the hooks already saw: the recompute of a preempted request.

vLLM V2 frees a preempted request's KV cache and, when the request resumes,
computes its prompt and its outputs so far again from position 0 (or from its
prefix-cache hit). The hidden states of those positions were postprocessed
before the preemption; hooks see every position of a request exactly once, so
outputs and state updates are the same with or without preemption
(docs/ARCHITECTURE.md, "Preemption").
"""

from __future__ import annotations

from typing import Iterable

import torch

from proto.messages import BatchLayout


class SeenPositions:
    """Per live request: how many of its positions the post-forward hooks have seen."""

    def __init__(self) -> None:
        self.upto: dict[str, int] = {}

    def fresh_rows(self, layout: BatchLayout, hidden: torch.Tensor | None
                   ) -> tuple[BatchLayout, torch.Tensor | None]:
        """The step's layout and hidden states without rows seen before (usually unchanged)."""
        fresh, rows = self.fresh_layout(layout)
        return fresh, take_rows(hidden, rows)

    def fresh_layout(self, layout: BatchLayout) -> tuple[BatchLayout, list[tuple[int, int]] | None]:
        """The step's layout without rows seen before, and the row ranges kept (None: all)."""
        qsl, computed = layout.query_start_loc, layout.num_computed_tokens
        req_ids: list[str] = []
        starts: list[int] = [0]
        fresh_computed: list[int] = []
        prefill_lens: list[int] = []
        rows: list[tuple[int, int]] = []
        replayed = False
        for i, req_id in enumerate(layout.req_ids or ()):
            start, end = qsl[i], qsl[i + 1]
            seen = self.upto.get(req_id, 0)
            skip = min(max(0, seen - computed[i]), end - start)
            self.upto[req_id] = max(seen, computed[i] + end - start)
            replayed |= skip > 0
            if skip and skip == end - start:
                continue  # every row of this request is a replay
            req_ids.append(req_id)
            fresh_computed.append(computed[i] + skip)
            prefill_lens.append(layout.prefill_lens[i])
            rows.append((start + skip, end))
            starts.append(starts[-1] + end - start - skip)
        if not replayed:
            return layout, None
        ids = layout.input_ids
        fresh_ids = [t for a, b in rows for t in ids[a:b]] if ids is not None else None
        return BatchLayout(req_ids, starts, fresh_computed, prefill_lens, fresh_ids), rows

    def forget(self, req_ids: Iterable[str]) -> None:
        for req_id in req_ids:
            self.upto.pop(req_id, None)


def take_rows(tensor: torch.Tensor | None, rows: list[tuple[int, int]] | None) -> torch.Tensor | None:
    """`tensor`'s row ranges `rows` (all of it when None)."""
    if tensor is None or rows is None:
        return tensor
    return torch.cat([tensor[a:b] for a, b in rows]) if rows else tensor[:0]
