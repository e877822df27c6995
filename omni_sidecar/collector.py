"""Python's cycle collector, run between a shim's steps rather than inside one (issue #15).

Every step allocates per request (state dicts, output chunks, a plan's tree) and keeps some (each
request's output log until it finishes), so the interpreter's own collector trips every few steps
wherever an allocation crosses its threshold: inside a StepEnd's postprocess or a plan's build,
while the shim waits. On the 2-core VM (bench.omni_step, 64 requests) a young collection took
~0.1 ms, a middle one ~1 ms and a full one up to 85 ms, walking torch's objects; those were the
sidecar's step tails the shim slept through (late plans).

So, by default (`--gc-between-steps`), the sidecar freezes what start-up made (modules, torch:
never garbage, never walked again; vLLM's engine freezes its heap alike, vllm/utils/gc_utils.py)
and collects itself, by the interpreter's own thresholds, where
no shim waits on it: after a StepEnd is answered and the next plan built, when no shim is inside a
step and no shim's message waits in a ring. A full collection (which walks every live request's
state and outputs, and the finished outputs kept for clients) waits for an idle loop (past its
polling window) unless it is `FULL_DEFERRED` times overdue: Python puts it off by the ratio of
long-lived objects, which it does not expose. A sidecar serving no steps (clients only) still
collects, on its loop's turns, once the count runs `OVERDUE` times past the threshold.
"""

from __future__ import annotations

import gc
import time

OVERDUE = 8  # times the youngest threshold: past it the loop collects wherever it is
FULL_DEFERRED = 10  # times the oldest threshold: a full collection waits this long for an idle loop


class CollectorPacer:
    """Counts every collection (the interpreter's or its own) and, when `paced`, runs them itself."""

    def __init__(self, paced: bool) -> None:
        self.paced = paced
        self.between_steps = 0  # collections run where no shim waited
        self.elsewhere = 0  # collections anywhere else (the interpreter's own, a hook's gc.collect())
        self.pause_us_max = 0.0
        self._thresholds = gc.get_threshold()
        self._ours = False
        self._started_at = 0.0
        self._was_enabled = gc.isenabled()

    def start(self) -> None:
        gc.callbacks.append(self._observe)
        if self.paced and self._thresholds[0] > 0:  # a threshold of 0: the collector is off already
            gc.freeze()
            gc.disable()

    def stop(self) -> None:
        if self._observe in gc.callbacks:
            gc.callbacks.remove(self._observe)
        if self.paced and self._was_enabled:
            gc.enable()

    def collect_due(self) -> None:
        """The collection the interpreter would run now, if one is due: call where no shim waits. A
        full one waits for an idle loop (`collect_idle`) unless `FULL_DEFERRED` times overdue."""
        if self.paced:
            self._collect(gc.get_count()[0] > self._thresholds[0])

    def collect_idle(self) -> None:
        """The loop has nothing to serve (past its polling window): a full collection put off, or a due one."""
        if self.paced:
            counts, thresholds = gc.get_count(), self._thresholds
            if thresholds[0] and counts[2] > thresholds[2]:
                self._run(2)
            else:
                self._collect(counts[0] > thresholds[0])

    def collect_if_overdue(self) -> None:
        """Once the count has run far past the threshold (no step has offered a place): collect now."""
        if self.paced:
            self._collect(gc.get_count()[0] > OVERDUE * self._thresholds[0])

    def _collect(self, due: bool) -> None:
        counts, thresholds = gc.get_count(), self._thresholds
        if not due or not thresholds[0]:
            return
        # As the interpreter picks, the oldest generation whose count has passed its threshold; but a
        # full one (walking every live request's state and outputs: 16 ms on the H200 host with 64
        # requests and the finished outputs kept) only when far overdue, the loop never idle.
        self._run(2 if counts[2] > FULL_DEFERRED * thresholds[2] else 1 if counts[1] > thresholds[1] else 0)

    def _run(self, generation: int) -> None:
        self._ours = True
        try:
            gc.collect(generation)
        finally:
            self._ours = False

    def _observe(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started_at = time.perf_counter()
            return
        self.pause_us_max = max(self.pause_us_max, (time.perf_counter() - self._started_at) * 1e6)
        if self._ours:
            self.between_steps += 1
        else:
            self.elsewhere += 1
