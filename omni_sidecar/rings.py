"""The sidecar's end of a shim connection's shared-memory rings (proto/shmring.py).

The server is one thread serving every session, so it must never block on one
shim: replies that do not fit in the shim's ring right now wait in a per-link
queue (in order) and are flushed on later loop turns. A shim that stops reading
for long enough to fill the queue is dropped like a broken connection.
"""

from __future__ import annotations

import collections
import logging
from typing import Callable

from proto.arena import ArenaError
from proto.messages import ArenaInfo
from proto.shmring import EMPTY, RingDuplex, ShmRing

log = logging.getLogger("omni_sidecar.rings")
MAX_QUEUED = 4096  # replies waiting for room in one shim's ring


class RingOverflow(RuntimeError):
    pass


class RingLink:
    """Rings of one session: [shim -> sidecar] is read here, [sidecar -> shim] written."""

    def __init__(self, duplex: RingDuplex) -> None:
        self.duplex = duplex
        self.queue: collections.deque[tuple[bytes, bool]] = collections.deque()
        self.closed = False
        self.kicks_sent = 0

    @classmethod
    def attach(cls, rings: list[ArenaInfo]) -> "RingLink":
        """Map the rings a Hello offers (and remove their names); ArenaError if they are not rings."""
        if len(rings) != 2:
            raise ArenaError(f"expected 2 rings (to and from the sidecar), the shim offered {len(rings)}")
        rx = ShmRing.attach(rings[0])
        try:
            tx = ShmRing.attach(rings[1])
        except BaseException:
            rx.close()
            raise
        return cls(RingDuplex(tx=tx, rx=rx))

    def send(self, frame: bytes, control: bool, sock_send: Callable[[bytes], None]) -> None:
        """In order after anything queued: ring if it fits, else MARK + socket (`sock_send`)."""
        self.queue.append((frame, control))
        self.flush(sock_send)
        if len(self.queue) > MAX_QUEUED:
            raise RingOverflow(f"{len(self.queue)} replies wait for room in the shim's ring")

    def flush(self, sock_send: Callable[[bytes], None]) -> None:
        wrote = False
        queue = self.queue
        while queue:
            frame, control = queue[0]
            outcome = self.duplex.send(frame, control)
            if outcome == "full":
                break
            queue.popleft()
            if outcome == "socket":
                sock_send(frame)  # the shim wakes on this frame itself
            else:
                wrote = True
        if wrote and self.duplex.peer_sleeping():
            sock_send(b"")  # kick
            self.kicks_sent += 1

    def recv(self, decode: Callable[[bytes | memoryview], object]) -> object:
        """Next message from the shim in connection order, or `EMPTY`."""
        return self.duplex.recv(decode)

    def set_sleeping(self, sleeping: bool) -> None:
        if not self.closed:
            self.duplex.rx.set_sleeping(sleeping)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            if self.queue:
                log.warning("closing a ring link with %d unsent replies", len(self.queue))
            self.duplex.close()


__all__ = ["EMPTY", "RingLink", "RingOverflow"]
