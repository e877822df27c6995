"""Python's cycle collector, run between a shim's steps rather than inside one.

Every step allocates per request (state dicts, output chunks, a plan's tree) and keeps some (each
request's output log until it finishes), so the interpreter's own collector trips every few steps
wherever an allocation crosses its threshold: inside a StepEnd's postprocess or a plan's build,
while the shim waits. On the 2-core VM (bench.omni_step, 64 requests) a young collection took
~0.1 ms, a middle one ~1 ms and a full one up to 85 ms, walking torch's objects; those were the
sidecar's step tails the shim slept through (late plans).

So, by default (`--gc-between-steps`), the sidecar collects what is garbage at start-up, freezes
the rest (modules, torch: never garbage, never walked again; vLLM's engine freezes its heap alike,
vllm/utils/gc_utils.py `freeze_gc_heap`), turns the automatic collector off and runs collections
itself, at three kinds of places:
- between steps (`collect_due`): after a StepEnd or StepTick is answered and the next plan built,
  when no shim is inside a step and nothing waits to be read or sent (`ready`): the young and
  middle generations as the interpreter's thresholds make them due; a full collection (every live
  request's state and outputs, and the finished outputs kept for clients: 16 ms on the H200 host
  with 64 requests) only once `FULL_DEFERRED` times overdue, since Python itself puts it off by the
  ratio of long-lived objects, which it does not expose;
- idle (`collect_idle`): the loop has had no traffic for `RING_IDLE_S` (an engine with nothing to
  run): whatever is due, a full collection first;
- overdue (`collect_if_overdue`): on any loop turn once the youngest count is `OVERDUE` times past
  its threshold (a loop no step offers a place to, e.g. while a client floods it), wherever it is.
`status` counts each kind, the interpreter's own (none while paced, unless a hook calls
`gc.collect()`) and the longest pause. Python 3.14's collector is incremental (its generations
and counts mean other things): there the interpreter's own is kept.
"""

from __future__ import annotations

import gc
import sys
import time
from typing import Callable, Literal

OVERDUE = 8  # times the youngest threshold: past it the loop collects wherever it is
FULL_DEFERRED = 10  # times the oldest threshold: a full collection between steps waits this long
PACEABLE = sys.version_info < (3, 14)  # a generational collector whose counts mean what `_due` reads

Where = Literal["between_steps", "idle", "overdue"]


class CollectorPacer:
    """Counts every collection (the interpreter's or its own) and, when `paced`, runs them itself."""

    def __init__(self, paced: bool) -> None:
        self.paced = paced and PACEABLE
        self.counts: dict[Where | Literal["elsewhere"], int] = {
            "between_steps": 0, "idle": 0, "overdue": 0, "elsewhere": 0}
        self.pause_us_max = 0.0
        self._thresholds = gc.get_threshold()
        self._where: Where | None = None
        self._started_at = 0.0
        self._was_enabled = True
        self._frozen = False

    def start(self) -> None:
        self._was_enabled = gc.isenabled()
        if self.paced and self._thresholds[0] > 0:  # a threshold of 0: the collector is off already
            gc.collect()  # what is garbage now is not frozen forever
            gc.freeze()
            gc.disable()
            self._frozen = True
        gc.callbacks.append(self._observe)

    def stop(self) -> None:
        if self._observe in gc.callbacks:
            gc.callbacks.remove(self._observe)
        if self._frozen:
            self._frozen = False
            gc.unfreeze()
            if self._was_enabled:
                gc.enable()

    def collect_due(self, ready: Callable[[], bool]) -> None:
        """Between steps: the young or middle collection due, if `ready()` says nobody waits on us
        (asked only when one is due); a full one only when far overdue."""
        if self._frozen:
            generation = self._due(1, FULL_DEFERRED)
            if generation >= 0 and ready():
                self._run(generation, "between_steps")

    def collect_idle(self) -> None:
        """No traffic for a while: a full collection put off, or whichever is due."""
        if self._frozen:
            generation = 2 if gc.get_count()[2] > self._thresholds[2] else self._due(1, 1)
            if generation >= 0:
                self._run(generation, "idle")

    def collect_if_overdue(self) -> None:
        if self._frozen:
            generation = self._due(OVERDUE, FULL_DEFERRED)
            if generation >= 0:
                self._run(generation, "overdue")

    def _due(self, young: int, full: int) -> int:
        """The generation to collect (-1: none): as the interpreter picks, the oldest whose count has
        passed its threshold, once the youngest's has passed `young` times its own; the oldest only
        past `full` times its own."""
        counts, thresholds = gc.get_count(), self._thresholds
        if counts[0] <= young * thresholds[0]:
            return -1
        return 2 if counts[2] > full * thresholds[2] else 1 if counts[1] > thresholds[1] else 0

    def _run(self, generation: int, where: Where) -> None:
        self._where = where
        try:
            gc.collect(generation)
        finally:
            self._where = None

    def _observe(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started_at = time.perf_counter()
            return
        self.pause_us_max = max(self.pause_us_max, (time.perf_counter() - self._started_at) * 1e6)
        self.counts[self._where or "elsewhere"] += 1
