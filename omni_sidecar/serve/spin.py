"""How long the sidecar keeps polling its rings after the last message before it sleeps.

A sleeping sidecar costs the shim on its critical path: a kick (a socket send) with each step
message and a kernel wake-up before every plan comes back. A fixed window shorter than a step's
quiet spell (on a GPU: the StepEnd handled, then nothing until the next StepBegin, 2-4 ms for a
small model) put the sidecar to sleep every step. So while steps come regularly the window
stretches to cover the quiet spells seen: the longest of the last `KEEP`, plus a quarter, up to
`max_s`. An engine that stops stepping sleeps after one window; its first long spell puts the
window back to `base_s` until regular steps push that spell out of the last `KEEP`.

Polling keeps one CPU busy (yielding it each turn), so by default the window stretches only on
hosts with cores to spare (`auto_max_us`); `--ring-spin-max-us` says otherwise.
"""

from __future__ import annotations

import collections
import os

KEEP = 16  # quiet spells remembered (a step brings 2-4: StepStart, StepBegin, StepEnd)
STRETCH = 1.25  # the window covers the longest spell remembered by this much
SPARE_CPUS = 8  # hosts with this many CPUs or more stretch by default
AUTO_MAX_US = 20_000  # a 1B-sized GPU step with room to spare; a longer spell is an engine gone idle


def auto_max_us(base_us: int, cpus: float | None = None) -> int:
    """The default stretch limit: AUTO_MAX_US with SPARE_CPUS or more CPUs to run on, else none;
    none either when polling is off (`base_us` 0: the operator asked for no polling)."""
    if cpus is None:
        cpus = cpus_to_run_on()
    return max(base_us, AUTO_MAX_US) if base_us and cpus >= SPARE_CPUS else base_us


def cpus_to_run_on(cgroup_cpu_max: str = "/sys/fs/cgroup/cpu.max") -> float:
    """CPUs this process may use: its affinity, capped by a cgroup (v2) quota (a container limited
    to 2 CPUs on a 64-core host has 2 to spare, not 64)."""
    cpus: float = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        with open(cgroup_cpu_max) as f:
            quota, period = f.read().split()[:2]
        if quota != "max":
            cpus = min(cpus, int(quota) / int(period))
    except (OSError, ValueError):
        pass
    return cpus


class SpinWindow:
    """The polling window in seconds (`seconds`), fed the quiet spells that ended in a message."""

    def __init__(self, base_us: int, max_us: int) -> None:
        self.base_s = base_us / 1e6
        self.max_s = max(base_us, max_us) / 1e6
        self.seconds = self.base_s
        self._quiet: collections.deque[float] = collections.deque(maxlen=KEEP)

    @property
    def stretches(self) -> bool:
        return self.max_s > self.base_s

    def note_quiet(self, quiet_s: float) -> None:
        """A message came `quiet_s` after the last one was handled."""
        if not self.stretches:
            return
        quiet = self._quiet
        quiet.append(quiet_s)
        longest = max(quiet)
        self.seconds = self.base_s if longest > self.max_s else min(self.max_s, max(self.base_s, longest * STRETCH))
