"""Forwards whose samples vLLM discarded under async scheduling (docs/ARCHITECTURE.md, "Async scheduling").

With async scheduling the engine schedules and launches step N+1 before it reads step N's
samples (its batch queue holds two steps; pipeline parallelism, which would make it longer, is
refused). A request that step N's sample finishes (a stop token; a stop string or an abort that
vLLM processes once it read them) already ran in step N+1: vLLM discards that sample, and the
request's finish notice reaches the worker with the first step it schedules after reading step N.
So a finish notice at step M for a request that ran in step M-1 names a discarded forward (M-1).
The shim's own finishes by length (worker_shim/step/finishes.py: the step that samples the last
token) wait one step here: that step's forward is discarded too when the request ended in the
step before it (a stop token, a stop string at its second-to-last token). vLLM always runs the next
step before it reads a step's samples (the request was still unfinished when it scheduled it), so
a held finish goes out at step M unless vLLM's notice at M names the request: then its finish is
that notice's, and its forward at M-1 discarded. With async scheduling off vLLM reads step N's
samples before it schedules step N+1: no notice names a discarded forward, nothing is kept and
length finishes go out at once.

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
        self.held: list[str] = []  # finishes by length in the previous step, not yet told (empty unless async)

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

    def hold(self, ending: list[str]) -> list[str]:
        """This step's finishes by length: those to tell now (all, with async scheduling off)."""
        if not self.async_scheduling:
            return ending
        self.held = list(ending)
        return []

    def take_held(self, finished: Iterable[str]) -> set[str]:
        """Of vLLM's finish notices, those of held length finishes: the request ended a step earlier."""
        if not self.held:
            return set()
        named = set(self.held).intersection(finished)
        self.held = [r for r in self.held if r not in named]
        return named

    def release(self) -> list[str]:
        """The held length finishes that vLLM's notice did not name: to tell now."""
        held, self.held = self.held, []
        return held
