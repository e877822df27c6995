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
  to that race. The sidecar's polling window stretches with the quiet spells
  between a shim's steps (`SpinWindow`).
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
        # Frames (and whether each is control) waiting for room, in order; read-only outside. The deque
        # itself, not a property: the serving loop and a step's send look at it every message.
        self.queued: collections.deque[tuple[bytes, bool]] = collections.deque()
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
        if not self.queued:  # the usual case: nothing waits, no queue to go through
            outcome = self.duplex.send(frame, how == "marked")
            if outcome == "socket":
                self._send_socket(frame)  # the peer wakes on this frame itself
            elif outcome == "ring" and wake and self.duplex.peer_sleeping() and self._kick():
                self.kicks_sent += 1
            if outcome != "full":
                return
        self.queued.append((frame, how == "marked"))
        self.flush(wake)
        if len(self.queued) > self._max_queued:
            raise RingOverflow(f"{len(self.queued)} replies wait for room in the peer's ring")

    def send_message(self, frame: bytes, msg: object) -> None:
        """`msg`, encoded as `frame`, as `route` and `wakes` say: a step message in one ring write
        (`send_now`) while it fits and nothing waits before it, else through `send`."""
        how, wake = route(msg), wakes(msg)
        if how != "ring" or not self.send_now(frame, wake):
            self.send(frame, how, wake=wake)

    def send_now(self, frame: bytes, wake: bool = True) -> bool:
        """A ring-routed frame in one ring write, kicking a sleeping reader if `wake`; False when it
        must take `send` (something queued first, too big, or no room). The per-step path: `send`'s
        routing and queue layers cost more than the write itself."""
        tx = self.duplex.tx
        if self.queued or len(frame) > tx.max_record or not tx.try_write(frame):
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
        queue = self.queued
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
            if self.queued:
                log.warning("closing a ring transport with %d unsent message(s)", len(self.queued))
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
        `SpinWindow`): give the CPU away once and say so (poll again soon)."""
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


# -- the spin window: how long a reader polls before it sleeps ---------------------------------
# A sleeping sidecar costs the shim on its critical path: a kick (a socket send) with each step
# message and a kernel wake-up before every plan comes back. A fixed window shorter than a step's
# quiet spell (on a GPU: the StepEnd handled, then nothing until the next StepBegin, 2-4 ms for a
# small model) would put the sidecar to sleep every step. So while steps come regularly the window
# stretches to cover the quiet spells seen: the longest of the last `KEEP`, plus a quarter, up to
# `max_s`. An engine that stops stepping sleeps after one window; its first long spell puts the
# window back to `base_s` until regular steps push that spell out of the last `KEEP`. Polling
# keeps one CPU busy (yielding it each turn), so by default the window stretches only on hosts
# with cores to spare (`auto_max_us`); `--ring-spin-max-us` says otherwise.

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
    "EMPTY", "MAX_QUEUED", "Route", "RingOverflow", "RingTransport", "SpinWindow", "WaitPolicy", "apply_curve_client",
    "auto_max_us", "cpus_to_run_on", "reply_problem", "route", "set_heartbeats", "wakes",
]
