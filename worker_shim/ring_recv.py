"""Replies read from the shared-memory rings: waiting for one, draining what arrived.

A mixin of worker_shim/channel.py's `SidecarChannel`, kept apart as its own concern: once the
sidecar accepted the rings, its replies arrive in connection order through the ring and, behind a
MARK, on the socket (proto/transport.py). Waiting spins, then sleeps until kicked (WaitPolicy),
ending early on the step timeout or when the socket monitor says the sidecar is gone; draining
takes what arrived without waiting. The handshake that offers the rings, the sends and the
socket-only path stay in channel.py.
"""

from __future__ import annotations

import os
import time

import zmq

from proto.messages import Message, StepResult
from proto.shmring import EMPTY, RingError
from worker_shim.errors import SidecarError

MARK_WAIT_MS = 50  # a MARK's frame is already on its way: wait for it in short steps
SOCKET_LOOK_S = 0.05  # with rings: read the socket at least this often when taking results, MARK or not


class RingReceive:
    """Needs the channel's `endpoint`, `rings`, `wait`, `sleeps`, `_sock`, `_results`, `_socket_look_due`,
    `take_results`, `peer_gone`, `_stash`, `_decode` and `_timeout`."""

    def poll_ring_results(self) -> list[StepResult]:
        """Results waiting in the ring now, socket untouched (a frame behind a MARK waits for the
        next `take_results`); without rings, `take_results`."""
        rings = self.rings
        if rings is None:
            return self.take_results()
        if not self._results and rings.nothing_to_read():  # most steps: one look at the ring's indices
            return []
        while (msg := self._ring_next()) is not None:
            self._stash(msg)
        if not self._results:
            return []
        out, self._results = self._results, []
        return out

    def _drain_ring(self) -> None:
        """Stash every message that arrived, in connection order. The socket is read when a MARK
        says a message waits there, else at most every SOCKET_LOOK_S: every other frame on it is a
        kick, or a frame a broken peer sent without its MARK (found then). Asking ZeroMQ costs a
        few µs, and a StepEnd step looks here each step."""
        rings = self.rings
        assert rings is not None
        now = time.monotonic()
        if now >= self._socket_look_due:
            self._socket_look_due = now + SOCKET_LOOK_S
            self._pull_socket(0)
        while True:
            msg = self._ring_next()
            if msg is not None:
                self._stash(msg)
            elif not rings.waiting_for_socket:
                return
            else:
                self._pull_socket(0)
                if not rings.socket_frames_waiting:
                    return  # the MARK's frame is not here yet: a later look takes it

    def _ring_recv(self, timeout_s: float) -> Message:
        """Spin, then sleep until kicked (WaitPolicy); the step timeout and the socket
        monitor end the wait early when the sidecar is late or gone."""
        rings = self.rings
        assert rings is not None
        rx = rings.duplex.rx
        if rx.has_data():
            msg = self._ring_next()
            if msg is not None:
                return msg
        busy_at = time.monotonic()
        deadline = busy_at + timeout_s
        # The reply usually comes within the spin window: until then watch only the ring's write
        # index (one shared-memory load and a sched_yield per turn, not the whole loop below).
        clock, give_way = time.monotonic, os.sched_yield
        spin_until = min(deadline, busy_at + self.wait.spin_us / 1e6)
        while not rx.has_data() and clock() < spin_until:
            give_way()
        while True:
            msg = self._ring_next()
            if msg is not None:
                return msg
            now = time.monotonic()
            if now >= deadline:
                raise self._timeout(timeout_s)
            if rings.waiting_for_socket:  # a MARK: its frame is on the socket, on its way
                self._pull_socket(max(1, min(MARK_WAIT_MS, int((deadline - now) * 1000))))
                if not rings.socket_frames_waiting and self.peer_gone():
                    raise SidecarError(f"omni-sidecar at {self.endpoint} closed the connection")
                continue
            if self.wait.spin(busy_at, now):
                continue
            nap_ms = self.wait.nap_ms(busy_at, now, deadline)
            msg = self.wait.sleep([rings], self._ring_next, lambda: self._nap(nap_ms))
            if msg is not None:
                return msg

    def _nap(self, wait_ms: int) -> None:
        if self.peer_gone():
            raise SidecarError(f"omni-sidecar at {self.endpoint} closed the connection")
        self.sleeps += 1
        self._pull_socket(wait_ms)

    def _ring_next(self) -> Message | None:
        """The next message in connection order, or None when there is none yet."""
        assert self.rings is not None
        try:
            msg = self.rings.duplex.recv(self._decode)  # RingTransport.recv, one layer less per poll
        except RingError as exc:
            raise SidecarError(f"bad shared-memory ring from the sidecar: {exc}") from None
        return None if msg is EMPTY else msg  # type: ignore[return-value]

    def _pull_socket(self, wait_ms: int) -> None:
        """Socket frames into the rings' order (each behind its MARK); kicks dropped."""
        sock, rings = self._sock, self.rings
        assert rings is not None
        if wait_ms > 0:
            sock.poll(wait_ms)
        while sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            rings.feed_socket(sock.recv(copy=True))
