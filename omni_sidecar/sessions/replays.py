"""Rows the hooks already saw: the recompute of a preempted request.

vLLM V2 frees a preempted request's KV cache and, when the request resumes,
computes its prompt and its outputs so far again from position 0 (or from its
prefix-cache hit). The hidden states of those positions were postprocessed
before the preemption; hooks see every position of a request exactly once, so
outputs and state updates are the same with or without preemption
(docs/ARCHITECTURE.md, "Preemption").
"""

from __future__ import annotations

from operator import add, gt, sub
from typing import Iterable

import torch

from proto.packed import StepLayout


class SeenPositions:
    """Per live request: how many of its positions the post-forward hooks have seen.

    Most steps replay nothing, and the same requests fill the same rows as in the step before
    (steady decode): for those the last step's per-row record (`_row_ends`) is compared with the
    step's counts column against column (C-level `map`s, no Python per row) and replaced; it is
    merged into `upto` only when the rows change, a request is forgotten, or the record is read.
    """

    def __init__(self) -> None:
        self._upto: dict[str, int] = {}
        self._row_ids: list[str] | None = None  # the last layout's requests, in row order
        self._row_ends: list[int] = []  # positions seen per row of `_row_ids` (newer than `_upto`)

    @property
    def upto(self) -> dict[str, int]:
        """Positions seen per request (the merged record: export, tests)."""
        self._merge_rows()
        return self._upto

    def fresh_rows(self, layout: StepLayout, hidden: torch.Tensor | None
                   ) -> tuple[StepLayout, torch.Tensor | None]:
        """The step's layout and hidden states without rows seen before (usually unchanged)."""
        fresh, rows = self.fresh_layout(layout)
        return fresh, take_rows(hidden, rows)

    def fresh_layout(self, layout: StepLayout) -> tuple[StepLayout, list[tuple[int, int]] | None]:
        """The step's layout without rows seen before, and the row ranges kept (None: all)."""
        ids = layout.req_ids or []
        qsl, computed = layout.query_start_loc, layout.num_computed_tokens
        n = len(ids)
        if n and (ids is self._row_ids or ids == self._row_ids):
            # The same requests in the same rows: a row replays only if it saw past its count now.
            if not any(map(gt, self._row_ends, computed)):
                self._row_ends = list(map(add, computed, map(sub, qsl[1:n + 1], qsl[:n])))
                return layout, None
        self._merge_rows()
        fresh, rows = self._fresh_by_row(layout)
        upto = self._upto
        self._row_ids, self._row_ends = ids, [upto[r] for r in ids]
        return fresh, rows

    def _fresh_by_row(self, layout: StepLayout) -> tuple[StepLayout, list[tuple[int, int]] | None]:
        """Row by row: a step whose rows changed, or in which some request replays."""
        qsl, computed = layout.query_start_loc, layout.num_computed_tokens
        upto = self._upto
        req_ids: list[str] = []
        starts: list[int] = [0]
        fresh_computed: list[int] = []
        prefill_lens: list[int] = []
        rows: list[tuple[int, int]] = []
        replayed = False
        for i, req_id in enumerate(layout.req_ids or ()):
            start, end = qsl[i], qsl[i + 1]
            seen = upto.get(req_id, 0)
            skip = min(max(0, seen - computed[i]), end - start)
            upto[req_id] = max(seen, computed[i] + end - start)
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
        return StepLayout(req_ids, starts, fresh_computed, prefill_lens, fresh_ids), rows

    def _merge_rows(self) -> None:
        if self._row_ids is not None:
            self._upto.update(zip(self._row_ids, self._row_ends))  # each at least what `_upto` had
            self._row_ids, self._row_ends = None, []

    def forget(self, req_ids: Iterable[str]) -> None:
        upto = self.upto
        for req_id in req_ids:
            upto.pop(req_id, None)


def take_rows(tensor: torch.Tensor | None, rows: list[tuple[int, int]] | None) -> torch.Tensor | None:
    """`tensor`'s row ranges `rows` (all of it when None)."""
    if tensor is None or rows is None:
        return tensor
    return torch.cat([tensor[a:b] for a, b in rows]) if rows else tensor[:0]
