"""Forwards whose samples vLLM discarded under async scheduling (docs/ARCHITECTURE.md, "Async scheduling").

With async scheduling the engine schedules and launches step N+1 before it reads step N's
samples (its batch queue holds two steps; pipeline parallelism, which would make it longer, is
refused). A request that step N's sample finishes (a stop token; a stop string or an abort that
vLLM processes once it read them) already ran in step N+1: vLLM discards that sample, and the
request's finish notice reaches the worker with the first step it schedules after reading step N.
So a finish notice at step M for a request that ran in step M-1 names a discarded forward (M-1),
unless the shim told that finish itself (length: the scheduler never schedules past
`max_tokens`). With async scheduling off vLLM reads step N's samples before it schedules step
N+1, so no notice names a discarded forward and nothing is kept.

Only the batches' request ids are read, never a device value: no step waits for one.
"""

from __future__ import annotations

from typing import Iterable

from proto.messages import Discarded


class DiscardWatch:
    def __init__(self, async_scheduling: bool = False) -> None:
        self.async_scheduling = async_scheduling
        self._last_step = -1  # the previous step's number and its batch's request ids (none: no forward)
        self._last_ran: list[str] = []

    def note_step(self, step: int, req_ids: list[str] | None) -> None:
        """A step ended (`req_ids`: its batch's; None: it ran no forward)."""
        if self.async_scheduling:
            self._last_step, self._last_ran = step, list(req_ids) if req_ids else []

    def discarded(self, finished: Iterable[str]) -> list[Discarded]:
        """Of vLLM's finish notices that the sidecar does not have from the shim, the requests the
        previous step ran: their forward there was discarded."""
        if not self._last_ran or not finished:
            return []
        ran = set(self._last_ran)
        return [Discarded(r, self._last_step) for r in sorted(finished) if r in ran]
