"""One connection's transport, the same on both sides: a ZeroMQ socket plus, when the
shim's Hello offered them and the Welcome accepted them, two shared-memory rings
(proto/shmring.py) for the per-step messages.

- Routing (`route`): which messages ride the ring, which go behind a MARK on the
  socket (control: one order per connection across both), which take the socket
  alone (the handshake's answer, sent before the peer has rings to read).
- Sending (`RingTransport`): into the ring while it fits, else MARK + socket; what
  does not fit right now waits in order in a queue, flushed by later calls; a peer
  that sleeps on its socket gets a kick (an empty frame) after a ring write.
- Waiting (`WaitPolicy`): poll with sched_yield for `spin_us` after the last
  message, then raise the sleeping flag, re-check the ring (a writer may have
  published before it could see the flag: x86-64 has no store-load order), then
  block on the socket for at most `sleep_ms`. The bounded sleep covers kicks lost
  to that race.
- ZeroMQ set-up both sides share: heartbeats, the CURVE client keys, the check of
  a reply to a request.

Imports pyzmq and proto only (never torch or vLLM): the shim and the sidecar use it.
"""

from __future__ import annotations

import collections
import logging
import os
from dataclasses import dataclass
from typing import Callable, Literal, TypeVar

import zmq

from proto.arena import ArenaError
from proto.errors import ProtoError
from proto.messages import (
    ArenaInfo,
    ErrorReply,
    Reject,
    StepBegin,
    StepEnd,
    StepPlan,
    StepResult,
    StepStart,
    StepTick,
    Welcome,
)
from proto.settings import HEARTBEAT_IVL_MS, HEARTBEAT_TIMEOUT_MS, RING_SLEEP_MS, RING_SPIN_US
from proto.shmring import EMPTY, RingDuplex, ShmRing

log = logging.getLogger("omni_sidecar.transport")
T = TypeVar("T")

Route = Literal["ring", "marked", "socket"]
# Per-step traffic (and the errors answering it) rides the ring.
_RING_MESSAGES = (StepStart, StepBegin, StepEnd, StepTick, StepPlan, StepResult, ErrorReply)
# The answer to a Hello leaves before the shim reads any ring: socket, no MARK.
_HANDSHAKE_REPLIES = (Welcome, Reject)
# Replies waiting for room in one peer's ring before the connection counts as stuck.
MAX_QUEUED = 4096


def route(msg: object) -> Route:
    """How `msg` travels on a connection whose rings are active."""
    if isinstance(msg, _RING_MESSAGES):
        return "ring"
    if isinstance(msg, _HANDSHAKE_REPLIES):
        return "socket"
    return "marked"


def wakes(msg: object) -> bool:
    """Does sending `msg` wake a reader that sleeps? Not a StepStart that wants no answer, nor a
    StepTick: nothing waits for them, and the sidecar reads them with the step's next message,
    within its bounded sleep, or when it looks before a hand-over (a kick costs the shim a
    syscall and, on a small host, the sidecar's wake-up on its own time)."""
    if isinstance(msg, StepStart):
        return msg.answer
    return not isinstance(msg, StepTick)


class RingOverflow(ProtoError):
    """More replies wait for room in a peer's ring than MAX_QUEUED: the peer stopped reading."""


class RingTransport:
    """The rings of one connection, in connection order with its socket.

    `send_socket(frame)` puts a frame on this connection's socket; `kick()` sends the
    empty wake-up frame and says whether it left (a full socket drops it: the
    sleeper re-checks within its bounded sleep anyway).
    """

    def __init__(self, duplex: RingDuplex, send_socket: Callable[[bytes], None],
                 kick: Callable[[], bool], max_queued: int = MAX_QUEUED) -> None:
        self.duplex = duplex
        self._send_socket = send_socket
        self._kick = kick
        self._max_queued = max_queued
        self._queue: collections.deque[tuple[bytes, bool]] = collections.deque()
        self.closed = False
        self.kicks_sent = 0

    @classmethod
    def attach(cls, rings: list[ArenaInfo], send_socket: Callable[[bytes], None],
               kick: Callable[[], bool]) -> "RingTransport":
        """Map the rings a Hello offers ([shim -> sidecar, sidecar -> shim]; their names are
        removed); ArenaError if they are not rings."""
        if len(rings) != 2:
            raise ArenaError(f"expected 2 rings (to and from the sidecar), the shim offered {len(rings)}")
        rx = ShmRing.attach(rings[0])
        try:
            tx = ShmRing.attach(rings[1])
        except BaseException:
            rx.close()
            raise
        return cls(RingDuplex(tx=tx, rx=rx), send_socket, kick)

    # -- sending ---------------------------------------------------------------

    def send(self, frame: bytes, how: Route, wake: bool = True) -> None:
        """In order after anything queued; RingOverflow when the queue passes its bound."""
        if how == "socket":
            self._send_socket(frame)
            return
        if not self._queue:  # the usual case: nothing waits, no queue to go through
            outcome = self.duplex.send(frame, how == "marked")
            if outcome == "socket":
                self._send_socket(frame)  # the peer wakes on this frame itself
            elif outcome == "ring" and wake and self.duplex.peer_sleeping() and self._kick():
                self.kicks_sent += 1
            if outcome != "full":
                return
        self._queue.append((frame, how == "marked"))
        self.flush(wake)
        if len(self._queue) > self._max_queued:
            raise RingOverflow(f"{len(self._queue)} replies wait for room in the peer's ring")

    def send_now(self, frame: bytes, wake: bool = True) -> bool:
        """A ring-routed frame in one ring write, kicking a sleeping reader if `wake`; False when it
        must take `send` (something queued first, too big, or no room). The per-step path: `send`'s
        routing and queue layers cost more than the write itself."""
        tx = self.duplex.tx
        if self._queue or len(frame) > tx.max_record or not tx.try_write(frame):
            return False
        if wake and tx.peer_sleeping() and self._kick():
            self.kicks_sent += 1
        return True

    def send_quiet(self, frame: bytes) -> bool:
        """A step message that wakes nobody (a StepStart wanting no answer, a StepTick): `send_now`
        without the kick."""
        return self.send_now(frame, wake=False)

    def nothing_to_read(self) -> bool:
        """No record waits in the receiving ring (socket frames wait for their MARK in it)."""
        return not self.duplex.rx.has_data()

    def flush(self, wake: bool = True) -> None:
        """Send what the ring has room for now (RingError: the ring is broken); kick a sleeping
        reader unless `wake` is False."""
        wrote = False
        queue = self._queue
        while queue:
            frame, control = queue[0]
            outcome = self.duplex.send(frame, control)
            if outcome == "full":
                break
            queue.popleft()
            if outcome == "socket":
                self._send_socket(frame)  # the peer wakes on this frame itself
            else:
                wrote = True
        if wrote and wake and self.duplex.peer_sleeping() and self._kick():
            self.kicks_sent += 1

    @property
    def queued(self) -> int:
        return len(self._queue)

    # -- receiving ---------------------------------------------------------------

    def recv(self, decode: Callable[[bytes | memoryview], T]) -> T | object:
        """The peer's next message in connection order, or `EMPTY`."""
        return self.duplex.recv(decode)

    def feed_socket(self, frame: bytes) -> bool:
        """A frame this connection received on its socket; False for a kick (nothing to read)."""
        if not frame:
            return False
        self.duplex.feed_socket(frame)
        return True

    @property
    def socket_frames_waiting(self) -> bool:
        """Socket frames not yet matched by their MARK (the ring holds older messages)."""
        return bool(self.duplex.socket_frames)

    @property
    def waiting_for_socket(self) -> bool:
        """A MARK heads the ring and its frame has not arrived on the socket yet."""
        return self.duplex.waiting_for_socket

    def set_sleeping(self, sleeping: bool) -> None:
        if not self.closed:
            self.duplex.rx.set_sleeping(sleeping)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            if self._queue:
                log.warning("closing a ring transport with %d unsent message(s)", len(self._queue))
            self.duplex.close()


@dataclass(frozen=True)
class WaitPolicy:
    """Spin, then sleep on the socket (see the module docstring).

    `idle_s`/`idle_sleep_ms`: after that long without traffic the sleeps stretch (the
    sidecar: an idle one should not wake 500 times a second).
    """

    spin_us: int = RING_SPIN_US
    sleep_ms: int = RING_SLEEP_MS
    idle_s: float = float("inf")
    idle_sleep_ms: int = 0

    def spin(self, busy_at: float, now: float, window_s: float | None = None) -> bool:
        """Inside the spin window (`spin_us`, or `window_s`: the sidecar's stretched one,
        omni_sidecar/serve/spin.py): give the CPU away once and say so (poll again soon)."""
        if now - busy_at < (self.spin_us / 1e6 if window_s is None else window_s):
            os.sched_yield()  # let vLLM's threads run first
            return True
        return False

    def nap_ms(self, busy_at: float, now: float, deadline: float | None = None) -> int:
        """How long one sleep on the socket may last (whole ms, what zmq_poll takes)."""
        ms = self.sleep_ms
        if now - busy_at > self.idle_s:
            ms = max(ms, self.idle_sleep_ms)
        if deadline is not None:
            ms = min(ms, int((deadline - now) * 1000))
        return max(1, ms)

    @staticmethod
    def sleep(transports: list[RingTransport], recheck: Callable[[], T | None],
              block: Callable[[], None]) -> T | None:
        """Raise the sleeping flags, re-check the rings, else `block` on the socket.

        Returns what the re-check found (None: it found nothing and we slept).
        """
        for transport in transports:
            transport.set_sleeping(True)
        try:
            found = recheck()
            if found is not None:
                return found
            block()
            return None
        finally:
            for transport in transports:
                transport.set_sleeping(False)


# -- ZeroMQ set-up both sides share ---------------------------------------------


def set_heartbeats(sock: zmq.Socket) -> None:
    """ZMTP heartbeats from libzmq's I/O thread: a peer that stops answering (SIGSTOP, a hung
    host, a container whose process is gone) is disconnected within the timeout."""
    sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)


def apply_curve_client(sock: zmq.Socket, keys_dir: str) -> None:
    """tcp:// only: our `client.key_secret` and the sidecar's public `server.key`."""
    import zmq.auth

    pub, sec = zmq.auth.load_certificate(os.path.join(keys_dir, "client.key_secret"))
    server_pub, _ = zmq.auth.load_certificate(os.path.join(keys_dir, "server.key"))
    sock.curve_secretkey, sock.curve_publickey, sock.curve_serverkey = sec, pub, server_pub


def reply_problem(request: object, reply: object, want: type) -> str:
    """What is wrong with `reply` as the answer to `request` ("" when it is a `want`)."""
    if isinstance(reply, ErrorReply):
        return f"sidecar rejected {type(request).__name__}: {reply.code}: {reply.message}"
    if not isinstance(reply, want):
        return f"expected {want.__name__}, sidecar sent {type(reply).__name__}"
    return ""


__all__ = [
    "EMPTY", "MAX_QUEUED", "Route", "RingOverflow", "RingTransport", "WaitPolicy", "apply_curve_client",
    "reply_problem", "route", "set_heartbeats", "wakes",
]
