"""Rolling latency window: p50/p99 over the last N samples, O(1) to record."""

from __future__ import annotations

from collections import deque


class LatencyWindow:
    def __init__(self, size: int = 4096) -> None:
        self._samples: deque[float] = deque(maxlen=size)

    def record(self, value: float) -> None:
        self._samples.append(value)

    def __len__(self) -> int:
        return len(self._samples)

    def percentile(self, q: float) -> float:
        if not self._samples:
            return 0.0
        ordered = sorted(self._samples)
        idx = min(len(ordered) - 1, max(0, round(q / 100.0 * (len(ordered) - 1))))
        return ordered[idx]

    def summary(self) -> tuple[float, float]:
        return self.percentile(50), self.percentile(99)
