"""Rejected frames: every one answered and counted, logged at most once per interval per peer.

A hostile or broken local peer can send frames as fast as the socket takes them;
one log line each would let it fill a disk. The first rejection from a peer is
logged at once, later ones are counted and summarised in one line per peer per
`interval_s` (with their codes). Metrics count every frame.
"""

from __future__ import annotations

import collections
import logging
import time
from dataclasses import dataclass, field

from omni_sidecar.serve.metrics import SidecarMetrics
from proto.messages import ErrorReply
from proto.settings import ERROR_TEXT_MAX

log = logging.getLogger("omni_sidecar.rejects")
REJECT_LOG_INTERVAL_S = 10.0
MAX_TRACKED_PEERS = 1024  # beyond this, new peers share one summary line
OTHER_PEERS = b"<other peers>"


@dataclass
class _PeerRejects:
    window_ends: float
    suppressed: int = 0
    codes: collections.Counter = field(default_factory=collections.Counter)


class RejectLog:
    def __init__(self, metrics: SidecarMetrics, interval_s: float = REJECT_LOG_INTERVAL_S) -> None:
        self.metrics = metrics
        self.interval_s = interval_s
        self.total = 0
        self._peers: dict[bytes, _PeerRejects] = {}

    def refuse(self, code: str, message: str, peer: bytes = b"") -> ErrorReply:
        """Count the rejected frame, log it or fold it into the peer's summary; the reply says why."""
        self.total += 1
        self.metrics.rejected_frames.labels(code).inc()
        now = time.monotonic()
        key = peer if peer in self._peers or len(self._peers) < MAX_TRACKED_PEERS else OTHER_PEERS
        state = self._peers.get(key)
        if state is None or now >= state.window_ends:
            if state is not None:
                self._summarise(key, state)
            self._peers[key] = _PeerRejects(window_ends=now + self.interval_s)
            log.warning("rejected a frame from peer %s (%s): %s; more from this peer are summarised "
                        "every %.0f s", _label(key), code, message[:ERROR_TEXT_MAX], self.interval_s)
        else:
            state.suppressed += 1
            state.codes[code] += 1
        return ErrorReply(code, message[:ERROR_TEXT_MAX])

    def flush(self) -> None:
        """Summarise and forget peers whose window has ended (called from the serving loop)."""
        if not self._peers:  # every loop turn: nothing to look at, usually
            return
        now = time.monotonic()
        for key, state in list(self._peers.items()):
            if now >= state.window_ends:
                self._summarise(key, state)
                del self._peers[key]

    def _summarise(self, key: bytes, state: _PeerRejects) -> None:
        if state.suppressed:
            codes = ", ".join(f"{c} x{n}" for c, n in state.codes.most_common())
            log.warning("rejected %d more frame(s) from peer %s in %.0f s (%s)", state.suppressed,
                        _label(key), self.interval_s, codes)


def _label(peer: bytes) -> str:
    return peer.decode() if peer == OTHER_PEERS else (peer.hex()[:16] or "?")
