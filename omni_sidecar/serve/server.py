"""The sidecar daemon's serving loop: a ZeroMQ ROUTER that answers shims and control clients.

Single-threaded on purpose: hook calls happen in step order, and the loop
never blocks on a peer. Every inbound frame is untrusted: size-capped,
schema-validated, and answered with an ErrorReply when rejected.

The rooms (docs/ARCHITECTURE.md, "Code map"): the socket (listener.py), the shim
connections (peers.py: session + transport), hot upgrade (omni_sidecar/upgrade/: the
handing-over and the taking-over side, each with its turn of this loop), client queries
(queries.py). This module binds, handles signals, drains and reloads, and routes each
message to the room that answers it.

While any shim uses shared-memory rings the loop serves every ring and the socket
together and waits as proto/transport.py's WaitPolicy says; after RING_IDLE_S
without any traffic the sleeps stretch to RING_IDLE_SLEEP_MS, so an idle sidecar
(or one whose shims went away) does not wake 500 times a second. Garbage in a ring
is answered and counted like a bad frame; that session is then dropped (a broken
ring cannot be resynchronised) and other sessions are unaffected.
"""

from __future__ import annotations

import logging
import signal
import time
from typing import Callable

import msgspec
import zmq

from omni_sidecar import __version__
from omni_sidecar.hook_api.hook_set import OmniHooks
from omni_sidecar.serve.collector import CollectorPacer
from omni_sidecar.serve.config import ServeConfig
from omni_sidecar.serve.listener import Listener
from omni_sidecar.serve.metrics import SidecarMetrics
from omni_sidecar.serve.peers import STEP_ENDS, PeerTable
from omni_sidecar.serve.rejects import RejectLog
from omni_sidecar.serve.queries import Queries
from omni_sidecar.serve.security import SecurityError
from omni_sidecar.sessions.store import FinishedOutputs
from omni_sidecar.upgrade.handing_over import HandingOver
from omni_sidecar.upgrade.taking_over import TakingOver
from omni_sidecar.upgrade.takeover_state import UpgradeParts
from proto.arena import sweep_stale
from proto.codec import Codec, FrameError
from proto.endpoint import check_endpoint, ipc_path
from proto.messages import (
    AppendPayload,
    Drain,
    Drained,
    Hello,
    OutputsQuery,
    Ping,
    Pong,
    Reject,
    StatusQuery,
    StatusReply,
    StepBegin,
    StepEnd,
    StepResult,
    StepStart,
    StepTick,
    SwitchReady,
    Takeover,
)
from proto.settings import RING_IDLE_S, RING_IDLE_SLEEP_MS
from proto.transport import SpinWindow, WaitPolicy, auto_max_us
from proto.version import PROTOCOL_MAJOR, PROTOCOL_VERSION

log = logging.getLogger("omni_sidecar.server")
DRAIN_IDLE_S = 1.0  # a draining sidecar exits once its sessions were quiet this long
# Inside the spin window the loop serves only the rings for this long between its housekeeping turns
# (reaping, the socket: a few microseconds each; see PeerTable.serve_hot).
HOT_SPIN_S = 200e-6
SOCKET_CHECK_S = 200e-6  # while the rings keep the loop busy, the socket is asked this often
# What is waiting on the socket when it is asked is served in one go, up to this many messages: a
# front end's outputs queries come one per stream at once and each is answered in microseconds,
# where one a turn kept the last of 64 waiting 64 turns (a step each).
SOCKET_BURST = 128
_STEP_MESSAGES = (StepBegin, StepEnd, StepStart, StepTick)  # a tuple: isinstance of a union is slower


class SidecarServer:
    def __init__(self, config: ServeConfig, hooks: OmniHooks) -> None:
        check_endpoint(config.endpoint, config.curve_keys or None)
        self.endpoint = config.endpoint  # the CLI moves it beside the running sidecar for a takeover
        self.hooks = hooks
        self.metrics_port = config.metrics_port
        self.drain_timeout_s = config.drain_timeout_s
        self.wait = WaitPolicy(spin_us=config.ring_spin_us, sleep_ms=max(1, config.ring_sleep_ms),
                               idle_s=RING_IDLE_S, idle_sleep_ms=RING_IDLE_SLEEP_MS)
        max_us = config.ring_spin_max_us if config.ring_spin_max_us >= 0 else auto_max_us(config.ring_spin_us)
        self.spin = SpinWindow(config.ring_spin_us, max_us)
        self.metrics = SidecarMetrics()
        self.rejects = RejectLog(self.metrics)
        self.codec = Codec(config.max_frame_bytes)
        self.finished = FinishedOutputs(config.keep_finished)
        self.listener = Listener(config.max_frame_bytes, config.allow_uids, config.curve_keys or None)
        self.peers = PeerTable(hooks, self.finished, self.metrics, self.listener, self.codec, self.rejects.refuse,
                               config.arena_bytes, config.ring)
        self.collector = CollectorPacer(config.gc_between_steps)
        self.queries = Queries(hooks, self.peers, self.finished, self.collector)
        upgrade = UpgradeParts(hooks, self.finished, self.peers, self.listener)
        self.handover = HandingOver(upgrade, self.rejects.refuse)
        self.takeover = TakingOver(upgrade, self.codec)
        self.on_reload: Callable[[], None] | None = None  # set by the CLI: re-reads the config on SIGHUP
        self._bound = False
        self._stop = False
        self._reload_requested = False
        self._draining = False
        self._drain_deadline = 0.0
        self._last_step = 0.0
        self._busy_at = time.monotonic()  # last ring or socket traffic, for the wait policy
        self._socket_due = 0.0  # a busy ring loop asks the socket again from then on

    # -- lifecycle -----------------------------------------------------------

    def bind(self) -> None:
        stale = sweep_stale()
        if stale:
            log.info("removed %d stale arena(s) left in /dev/shm by dead processes", len(stale))
        self._refuse_if_serving()
        self.listener.bind(self.endpoint)
        self._bound = True
        if self.metrics_port:
            self.metrics.serve(self.metrics_port)
            log.info("Prometheus metrics on http://127.0.0.1:%d/metrics", self.metrics_port)
        log.info(
            "omni-sidecar %s listening on %s with hook set %r (needs %s); protocol %s",
            __version__, self.endpoint, self.hooks.name, self.hooks.needs, PROTOCOL_VERSION,
        )

    def _refuse_if_serving(self) -> None:
        """Two sidecars on one socket would split a shim's traffic: refuse to start."""
        from omni_sidecar.client import answers

        if ipc_path(self.endpoint) is not None and answers(self.endpoint):
            raise SecurityError(
                f"another omni-sidecar is serving at {self.endpoint}; stop it first (SIGTERM drains it)"
            )

    def request_stop(self, *_: object) -> None:
        self._stop = True

    def begin_drain(self, *_: object) -> None:
        """Refuse new shims, keep serving connected ones until they go quiet, then exit."""
        if not self._draining:
            self._draining = True
            self._last_step = max(self._last_step, time.monotonic())  # idle counts from now
            self._drain_deadline = time.monotonic() + self.drain_timeout_s
            log.info(
                "draining: no new sessions; exiting when %d session(s) are idle for 1 s or in %.0f s",
                len(self.peers), self.drain_timeout_s,
            )

    def _request_reload(self, *_: object) -> None:
        self._reload_requested = True

    def _drained(self) -> bool:
        now = time.monotonic()
        return not self.peers or now - self._last_step > DRAIN_IDLE_S or now > self._drain_deadline

    def serve_forever(self, install_signals: bool = True) -> None:
        if not self._bound:
            self.bind()
        if install_signals:
            signal.signal(signal.SIGTERM, self.begin_drain)
            signal.signal(signal.SIGINT, self.request_stop)
            signal.signal(signal.SIGHUP, self._request_reload)
        self.collector.start()
        try:
            while not self._stop:
                self.collector.collect_if_overdue()
                self.peers.reap()
                self.rejects.flush()
                if self._reload_requested:
                    self._reload_requested = False
                    if self.on_reload is not None:
                        self.on_reload()
                if self._draining and self._drained():
                    break
                if self.handover.pending and self.handover.turn(
                        self._dispatch, lambda: self._serve_socket(0), self.takeover.old_endpoint or self.endpoint,
                        self.takeover.unclaimed):
                    self.begin_drain()  # handed over: the successor serves the shims from now
                if self.takeover.waiting:
                    self.takeover.turn(self._dispatch, self._serve, self.wait.sleep_ms, self._hello, self._status)
                    if self.takeover.failed:
                        break
                elif self.peers.ring_transports():
                    self._serve_rings_once()
                else:
                    try:
                        frames = self.listener.recv_frames()
                    except zmq.Again:  # the listener's RECV_TIMEOUT_MS without a frame: idle
                        if self.peers.all_between_steps():
                            self.collector.collect_idle()
                        continue
                    self._serve(frames)
        finally:
            self.close()

    def close(self) -> None:
        self.collector.stop()
        self.peers.end_all()
        self.listener.close()
        self.takeover.close()
        self.listener.flush()
        log.info("omni-sidecar stopped")

    # -- dispatch ------------------------------------------------------------

    def _serve(self, frames: list[bytes]) -> None:
        if self.peers.on_socket_frames(frames, self._dispatch):
            return
        if len(frames) != 2:
            self._reject(frames[0], "bad_envelope", f"expected 1 body frame, got {len(frames) - 1}")
            return
        ident, body = frames
        try:
            msg = self.codec.decode(body)
        except FrameError as exc:
            self._reject(ident, exc.code, str(exc))
            return
        self._dispatch(ident, msg)

    def _dispatch(self, ident: bytes, msg: object) -> None:
        try:
            reply = self._handle(ident, msg)
        except Exception as exc:  # never let one peer's frame stop the server
            log.exception("error handling %s", type(msg).__name__)
            reply = self.rejects.refuse("internal", f"{type(msg).__name__}: {exc!r}", ident)
        if reply is not None:
            self.peers.send(ident, reply)
        peer = self.peers.get(ident)
        if peer is not None:
            if type(msg) is StepEnd:  # answered: the next step's plan while the shim schedules it
                peer.after_step_end()
            elif peer.between_steps_due:
                peer.between_steps()
            if type(msg) in STEP_ENDS:  # answered, the next plan built: a place nobody waits on us
                self.collector.collect_due(self.peers.all_between_steps)

    def _handle(self, ident: bytes, msg: object):
        if isinstance(msg, _STEP_MESSAGES):
            peer = self.peers.get(ident)
            if peer is None:
                return self.rejects.refuse("no_session", "send Hello before step messages", ident)
            self._last_step = time.monotonic()
            peer.note_step(msg)  # also: MirrorUpdates the shim applied (StepStart)
            if type(msg) is StepBegin:  # first: the shim blocks on its answer
                return peer.session.step_begin(msg)
            if isinstance(msg, StepStart):
                return Pong(msg.step) if msg.answer else None
            if isinstance(msg, StepTick):  # unanswered, unless the shim must learn of a successor
                peer.session.step_tick(msg)
                return StepResult(step=msg.step, switch_to=self.handover.switch_to) if self.handover.switch_to else None
            result = peer.session.step_end(msg)
            if self.handover.switch_to:
                result = msgspec.structs.replace(result, switch_to=self.handover.switch_to)
            return result
        if isinstance(msg, Hello):
            return self._hello(ident, msg)
        if isinstance(msg, Ping):
            return Pong(msg.nonce)
        if isinstance(msg, StatusQuery):
            if self.takeover.waiting:  # answered once we own the state: that is what `upgrade` waits for
                return self.takeover.defer_status(ident)
            return self._status()
        if isinstance(msg, OutputsQuery | AppendPayload):
            return self.queries.answer(ident, msg)
        if isinstance(msg, Drain):
            self.begin_drain()
            return Drained(len(self.peers))
        if isinstance(msg, Takeover):  # sessions go once each is between steps (_hand_over_ready)
            return self.handover.accept(ident, msg, busy=self._draining)
        if isinstance(msg, SwitchReady):
            return self.handover.switch_ready(ident, msg)
        return self.rejects.refuse("unexpected", f"{type(msg).__name__} is not a request the sidecar serves", ident)

    def _status(self) -> StatusReply:
        return self.queries.status(self._draining, self.rejects.total)

    def start_takeover(self, old_endpoint: str, timeout_s: float) -> None:
        """Bound on a side address already; ask the running sidecar to hand over."""
        self.takeover.start(self.endpoint, old_endpoint, timeout_s)

    def _hello(self, ident: bytes, hello: Hello, fd: int | None = None):
        fd = self.listener.last_fd if fd is None else fd  # the connection this Hello came on
        if hello.protocol_major != PROTOCOL_MAJOR:
            log.error(
                "refused shim rank %d: protocol %d.%d, sidecar speaks %s",
                hello.rank, hello.protocol_major, hello.protocol_minor, PROTOCOL_VERSION,
            )
            return Reject(
                f"protocol major version mismatch: shim speaks {hello.protocol_major}."
                f"{hello.protocol_minor}, sidecar speaks {PROTOCOL_VERSION}; install matching "
                "omni-sidecar versions on both sides"
            )
        if self._draining:
            return Reject("sidecar is draining; connect to its successor")
        resumed = None
        if hello.resume_token:
            if not self.takeover.knows(hello.resume_token):
                if self.takeover.waiting:
                    self.takeover.waiting_hellos.append((ident, hello, fd))  # the state is on its way
                    return None
                return Reject(f"unknown resume token {hello.resume_token!r}")
            resumed = self.takeover.resume(hello.resume_token) or {}
        return self.peers.admit(ident, hello, resumed, fd)

    def _reject(self, ident: bytes, code: str, message: str) -> None:
        self.peers.send(ident, self.rejects.refuse(code, message, ident))

    # -- shared-memory rings ---------------------------------------------------------

    def _serve_rings_once(self) -> None:
        """One loop turn while ring sessions exist: rings and socket; then, inside the spin window,
        the rings alone for up to HOT_SPIN_S (`PeerTable.serve_hot`); past it, sleep."""
        started = time.monotonic()
        busy = ring_busy = self.peers.pump(self._dispatch)
        now = time.monotonic()
        # The socket (kicks, control, frames behind a MARK: a MARK leaves pump idle) is asked every
        # turn that served nothing; while the rings keep the loop busy, every SOCKET_CHECK_S: asking
        # costs more than reading a ring, and the shim's next step message is on its way.
        if not busy or now >= self._socket_due:
            self._socket_due = now + SOCKET_CHECK_S
            served = 0
            while served < SOCKET_BURST and self.listener.readable():
                self._serve(self.listener.recv_frames())
                served += 1
            busy = busy or served > 0
        if ring_busy:  # only step traffic stretches the window: a client polling status must not
            self.spin.note_quiet(started - self._busy_at)
        if busy:
            self._busy_at = now
        if busy or self.wait.spin(self._busy_at, now, self.spin.seconds):  # the rings alone for a while (serve_hot)
            self._busy_at = self.peers.serve_hot(self._dispatch, now + HOT_SPIN_S, self._busy_at,
                                                 self.spin, self._loop_wanted, idle=not busy)
            return
        nap_ms = self.wait.nap_ms(self._busy_at, now)
        if now - self._busy_at >= RING_IDLE_S and self.peers.all_between_steps():
            self.collector.collect_idle()
        found = self.wait.sleep(self.peers.ring_transports(), lambda: self.peers.pump(self._dispatch) or None,
                                lambda: self._serve_socket(nap_ms))
        if found:  # written before the writer could see our flags
            self.spin.note_quiet(now - self._busy_at)
            self._busy_at = time.monotonic()

    def _loop_wanted(self) -> bool:
        """Something the loop's turn must see now (ends a hot turn early)."""
        return self._stop or self.handover.pending or self.takeover.waiting

    def _serve_socket(self, wait_ms: int) -> bool:
        if not self.listener.poll(wait_ms):
            return False
        self._serve(self.listener.recv_frames())  # a kick, or control traffic
        return True
