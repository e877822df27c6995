"""The shim connections the sidecar serves: each one (`ShimPeer`: its session and its transport)
and the table of them (`PeerTable`): admitted by Hello, ended in one place.

Every way a session ends goes through `ShimPeer.end(reason)`: the worker process exited
(reaper), the session moved to a successor (hot upgrade), the shim said Hello again, the
sidecar stops, or the rings broke. The table also does the per-turn work over all of them:
reaping peers whose worker process is gone, and serving their rings fairly (one message per
ring peer per turn).
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any, Callable, Literal

from omni_sidecar import __version__
from omni_sidecar.hook_api.hook_set import OmniHooks, wire_needs
from omni_sidecar.serve.listener import Listener
from omni_sidecar.serve.metrics import SidecarMetrics
from omni_sidecar.sessions.session import Session
from omni_sidecar.sessions.store import FinishedOutputs
from proto.codec import Codec, FrameError
from proto.endpoint import process_gone
from proto.errors import ProtoError
from proto.messages import (ErrorReply, Hello, Message, Reject, StepBegin, StepEnd, StepStart, StepTick, SwitchReady,
                            Welcome)
from proto.shmring import EMPTY, RingError
from proto.transport import RingOverflow, RingTransport, SpinWindow, route
from proto.version import PROTOCOL_MAJOR, PROTOCOL_MINOR

log = logging.getLogger("omni_sidecar.peers")
REAP_INTERVAL_S = 2.0
DISCONNECT_CHECK_S = 0.002  # closed connections are looked for this often (not every loop turn)
DRAIN_ROUNDS_MAX = 64  # reading what shims wrote before a hand-over decision: a busy one may not stop

Dispatch = Callable[[bytes, object], None]
Refuse = Callable[[str, str, bytes], ErrorReply]
STEP_ENDS = (StepEnd, StepTick)  # a tuple: isinstance of a union is slower, and this runs per message
EndReason = Literal["worker_exited", "disconnected", "handed_over", "replaced", "sidecar_stopped", "bad_ring", "ring_overflow"]


class ShimPeer:
    def __init__(self, ident: bytes, session: Session, listener: Listener, codec: Codec, fd: int = -1) -> None:
        self.ident = ident
        self.fd = fd  # the connection's file descriptor in this process (-1: unknown)
        self.session = session
        self._listener = listener
        self._codec = codec
        self.rings: RingTransport | None = None
        self.in_step = False  # a StepStart or StepBegin came, its StepEnd (or StepTick) not yet
        self.last_step_at = time.monotonic()  # admission counts: a just-switched shim may step at once
        self.switch_ready = False  # sent SwitchReady: it waits for its SwitchAck, sending nothing
        session.appends.to_shim = self.send  # MirrorUpdates, unsolicited
        self.between_steps_due = False  # the hooks' between-steps work waits for the message in the ring

    def after_step_end(self) -> None:
        """A StepEnd answered: the next step's plan, built ahead; then the hooks' work put off to
        between steps, unless the shim's next message already waits in the ring (it is answered
        first, then `between_steps`)."""
        session = self.session
        try:
            session.plan_ahead()
        except Exception:  # e.g. the device: the StepBegin is planned when it comes, as without
            log.exception("building session %d's next plan ahead failed; it is planned when asked", session.id)
            session.drop_plan_ahead()
        if not session.works_between_steps:
            return
        rings = self.rings
        if rings is not None and not rings.closed and rings.duplex.rx.has_data():
            self.between_steps_due = True
        else:
            session.between_steps()

    def between_steps(self) -> None:
        if self.between_steps_due:
            self.between_steps_due = False
            self.session.between_steps()

    def note_step(self, msg: StepStart | StepBegin | StepEnd | StepTick) -> None:
        self.in_step = not isinstance(msg, STEP_ENDS)
        self.last_step_at = time.monotonic()
        if isinstance(msg, StepStart) and self.session.appends.unacked:
            self.session.appends.mirror_applied(msg.mirror_seq, msg.step)

    def note_switch_ready(self, msg: SwitchReady) -> None:
        """The shim waits for its SwitchAck; MirrorUpdates it did not apply never reach it."""
        self.switch_ready = True
        self.session.appends.mirror_applied(msg.mirror_seq, msg.last_step + 1, final=True)

    def idle(self, now: float, quiet_s: float) -> bool:
        """Can go to a successor now: waiting for its SwitchAck, or between steps for `quiet_s`
        (docs/ARCHITECTURE.md, Hot upgrade: the shim re-checks at its next step after that long)."""
        if self.switch_ready:
            return True
        if self.session.appends.unacked:  # a MirrorUpdate in flight: hand over once the shim applied it
            return False
        return not self.in_step and now - self.last_step_at >= quiet_s

    def attach_rings(self) -> None:
        """Map the rings the Hello offered; on failure this connection stays on the socket."""
        hello = self.session.hello
        try:
            self.rings = RingTransport.attach(list(hello.rings), self._send_frame, self._kick)
        except Exception as exc:  # not rings, gone, too big: this connection uses the socket
            log.warning("shim rank %d offered rings that cannot be used (%s); ZeroMQ only", hello.rank, exc)

    def send(self, msg: Message) -> None:
        """As the transport routes it; ProtoError when the rings broke or the shim stopped reading."""
        frame = self._codec.encode(msg)
        rings = self.rings
        if rings is None:
            self._send_frame(frame)
            return
        rings.send_message(frame, msg)  # a step reply: one ring write, as a rule

    def flush(self) -> None:
        if self.rings is not None and self.rings.queued:
            self.rings.flush()

    def end(self, reason: EndReason, detail: str = "", farewell: Message | None = None) -> list[str]:
        """Release everything this connection holds; `farewell` is its last message.

        Returns the live requests that end with an error (only when the worker is gone).
        """
        failed: list[str] = []
        if reason in ("worker_exited", "disconnected"):
            failed = self.session.abandon(detail)
            status = self.session.status()
            log.log(logging.WARNING if failed else logging.INFO,
                    "session %d ended: its vLLM worker (pid %d) is gone (%s) after %d steps (%d planned ahead, "
                    "%d tensors sent as stacked rows); %d live request(s) end with an error, arenas and rings "
                    "released", self.session.id, self.session.hello.pid, detail, status.steps,
                    status.plans_ahead_used, status.stacked_rows, len(failed))
        elif reason in ("bad_ring", "ring_overflow"):
            log.error("session %d dropped: %s", self.session.id, detail)
        if farewell is not None:
            self._say_farewell(farewell)
        if self.rings is not None:
            self.rings.close()
        self.session.close()
        return failed

    def _say_farewell(self, msg: Message) -> None:
        frame = self._codec.encode(msg)
        try:
            if self.rings is not None and not self.rings.closed:
                self.rings.send(frame, route(msg))  # behind anything still queued there
                return
        except ProtoError:
            pass  # unmarked: the shim drops the connection either way
        self._send_frame(frame)

    def _send_frame(self, frame: bytes) -> None:
        self._listener.send(self.ident, frame)

    def _kick(self) -> bool:
        return self._listener.send(self.ident, b"")


class PeerTable:
    """Shim peers by ZeroMQ identity.

    `refuse(code, message, peer)` makes (and counts) the ErrorReply for a rejected frame.
    """

    def __init__(self, hooks: OmniHooks, finished: FinishedOutputs, metrics: SidecarMetrics,
                 listener: Listener, codec: Codec, refuse: Refuse, arena_bytes: int, rings: bool) -> None:
        self.hooks = hooks
        self.finished = finished
        self.metrics = metrics
        self.listener = listener
        self.codec = codec
        self.refuse = refuse
        self.arena_bytes = arena_bytes
        self.rings_enabled = rings
        self._peers: dict[bytes, ShimPeer] = {}
        # The peer by identity, or None: the dict's own get (asked twice a message; a method around it
        # would be a Python call each time).
        self.get: Callable[[bytes], ShimPeer | None] = self._peers.get
        self._next_session = 1
        self._next_reap = 0.0
        self._next_disconnect_check = 0.0

    def __len__(self) -> int:
        return len(self._peers)

    def idle(self, quiet_s: float) -> list[bytes]:
        """Identities of the peers with no step in flight for `quiet_s`."""
        now = time.monotonic()
        return [ident for ident, peer in self._peers.items() if peer.idle(now, quiet_s)]

    def sessions(self) -> list[Session]:
        return [p.session for p in self._peers.values()]

    def live_request(self, req_id: str) -> tuple[Session, str] | None:
        """The session serving the request a client names, and vLLM's id for it."""
        for peer in self._peers.values():
            found = peer.session.resolve(req_id)
            if found is not None:
                return peer.session, found
        return None

    # -- admission and ending -----------------------------------------------------

    def admit(self, ident: bytes, hello: Hello, resumed: dict[str, Any] | None, fd: int = -1) -> Welcome | Reject:
        """A new session for this identity (ending the one it had); `resumed`: handed-over state.

        `fd` is the connection the Hello came on: when it closes, the session ends (`reap`)."""
        self._end_disconnected()  # first, so a reused descriptor is never blamed on the new peer
        if ident in self._peers:
            self.end(ident, "replaced")
        session = Session(self._next_session, hello, self.hooks, self.finished, self.metrics)
        try:
            session.open_arenas(self.arena_bytes)
        except Exception as exc:
            session.close()
            return Reject(f"cannot open the shim's arenas: {exc}")
        self._next_session += 1
        peer = ShimPeer(ident, session, self.listener, self.codec, fd)
        if hello.rings and self.rings_enabled:
            peer.attach_rings()
        self._peers[ident] = peer
        if resumed is not None:
            session.import_(resumed)
            log.info("session %d resumed %d request(s) handed over by the predecessor",
                     session.id, len(session.requests))
        self.metrics.sessions.set(len(self._peers))
        log.info(
            "session %d: shim rank %d/%d, vLLM %s on %s, model %s",
            session.id, hello.rank, hello.world_size, hello.vllm_version, hello.platform, hello.model,
        )
        out = session.arenas.out
        return Welcome(
            protocol_major=PROTOCOL_MAJOR,
            protocol_minor=PROTOCOL_MINOR,
            sidecar_version=__version__,
            hook_set=self.hooks.name,
            needs=wire_needs(self.hooks),
            session=session.id,
            arenas=[out.arena.info()] if out is not None else [],
            consumer_events=session.arenas.consumer_events,
            rings=peer.rings is not None,
        )

    def end(self, ident: bytes, reason: EndReason, detail: str = "", farewell: Message | None = None) -> None:
        peer = self._peers.pop(ident, None)
        if peer is None:
            return
        peer.end(reason, detail, farewell)
        self.metrics.sessions.set(len(self._peers))

    def end_all(self) -> None:
        for ident in list(self._peers):
            self.end(ident, "sidecar_stopped")

    def reap(self) -> None:
        """End sessions whose connection closed (any PID namespace: heartbeats close a vanished
        peer's connection), and, checked every REAP_INTERVAL_S, those whose vLLM worker process
        exited (our PID namespace only; usually noticed first)."""
        now = time.monotonic()
        if now >= self._next_disconnect_check:  # asking the monitor costs more than a ring read
            self._next_disconnect_check = now + DISCONNECT_CHECK_S
            self._end_disconnected()
        if now < self._next_reap:
            return
        self._next_reap = now + REAP_INTERVAL_S
        for ident, peer in list(self._peers.items()):
            hello = peer.session.hello
            if process_gone(hello.pid, hello.pid_namespace):
                self.end(ident, "worker_exited", f"the vLLM worker process (pid {hello.pid}) exited")

    def _end_disconnected(self) -> None:
        for fd in self.listener.disconnected_fds():
            for ident, peer in list(self._peers.items()):
                if peer.fd == fd:
                    self.end(ident, "disconnected", "its connection closed: the process exited, or "
                             "stopped answering heartbeats")

    # -- traffic -------------------------------------------------------------------

    def send(self, ident: bytes, msg: Message) -> None:
        peer = self._peers.get(ident)
        if peer is None:
            self.listener.send(ident, self.codec.encode(msg))
            return
        try:
            peer.send(msg)
        except RingOverflow as exc:
            self._drop(ident, "ring_overflow", str(exc))
        except ProtoError as exc:
            self._drop(ident, "bad_ring", str(exc))

    def _drop(self, ident: bytes, reason: EndReason, message: str) -> None:
        """A ring we cannot trust any more: tell the shim (if we still can), end the session."""
        farewell = self.refuse(reason, f"{message}; session closed, reconnect", ident)
        self.end(ident, reason, message, farewell)

    def all_between_steps(self) -> bool:
        """No shim is inside a step, and nothing waits to be read (a ring, the socket) or sent (a
        reply queued for ring space): nobody waits on us."""
        for peer in self._peers.values():
            if peer.in_step or peer.between_steps_due:
                return False
            rings = peer.rings
            if rings is not None and not rings.closed and (rings.duplex.rx.has_data() or rings.queued):
                return False
        return not self.listener.readable()

    def ring_transports(self) -> list[RingTransport]:
        return [p.rings for p in self._peers.values() if p.rings is not None and not p.rings.closed]

    def pump(self, dispatch: Dispatch) -> bool:
        """At most one message per ring peer (fair across peers); True if any was served."""
        busy = False
        for ident, peer in list(self._peers.items()):
            if peer.rings is None or peer.rings.closed:
                continue
            try:
                peer.flush()
            except ProtoError as exc:
                self._drop(ident, "bad_ring", str(exc))
                continue
            busy |= self.serve_one(peer, dispatch)
        return busy

    def serve_hot(self, dispatch: Dispatch, until: float, busy_at: float, spin: SpinWindow,
                  loop_wanted: Callable[[], bool], idle: bool = False) -> float:
        """Serve ring messages as they land, with no loop turn in between, until `until` or the spin
        window (`spin.seconds`) past the last one: one shared-memory load per ring and a sched_yield
        per idle turn; each quiet spell that ends in a message is noted in `spin` (`idle`: the
        caller's turn found nothing, so the first message found ends one). Returns when the last
        message was served (the new `busy_at`).

        Why: the server loop's turn (reaping, the socket, hand-over checks) costs several
        microseconds, and a shim's next step message lands while the loop is in one. It returns at
        once when the loop must look: a MARK (its frame is on the socket), replies queued for room,
        a session that ended, or `loop_wanted()` after a message (a stop, a hand-over).
        """
        count = len(self._peers)
        rings = [(peer, peer.rings, peer.rings.duplex.rx) for peer in self._peers.values()
                 if peer.rings is not None and not peer.rings.closed]
        clock, give_way = time.monotonic, os.sched_yield
        while True:
            served = False
            for peer, transport, rx in rings:
                if transport.closed or transport.queued:
                    return busy_at
                if rx.has_data():
                    if idle:  # a quiet spell ends here: one clock read per spell, none per message
                        spin.note_quiet(clock() - busy_at)
                        idle = False
                    if not self.serve_one(peer, dispatch):
                        return busy_at  # a MARK: its frame comes on the socket
                    served = True
                    if len(self._peers) != count or loop_wanted():
                        return clock()
            now = clock()
            if served:
                busy_at = now
            else:
                idle = True
            # At the deadline even when busy: a ring that never runs dry must not hold the loop's housekeeping off.
            if now >= until or now - busy_at >= spin.seconds:
                return busy_at
            if not served:
                give_way()  # let vLLM's threads run first

    def drain(self, dispatch: Dispatch, serve_socket: Callable[[], bool]) -> bool:
        """Serve all the shims wrote before now, rings and socket; False if it kept coming."""
        for _ in range(DRAIN_ROUNDS_MAX):
            if not (self.pump(dispatch) | serve_socket()):
                return True
        return False

    def on_socket_frames(self, frames: list[bytes], dispatch: Dispatch) -> bool:
        """Frames from a ring peer's socket: a kick, or the message behind a MARK.

        False when the sender has no rings (its frames are served as they come)."""
        peer = self._peers.get(frames[0])
        if peer is None or peer.rings is None:
            return False
        if len(frames) != 2:
            self.send(peer.ident, self.refuse("bad_envelope", f"expected 1 body frame, got {len(frames) - 1}", peer.ident))
            return True
        rings = peer.rings
        if not rings.feed_socket(frames[1]):
            return True  # a kick: the loop reads the rings next
        # Everything the shim put in the ring before it is older: serve up to and including it.
        while not rings.closed and rings.socket_frames_waiting:
            if not self.serve_one(peer, dispatch):
                break
        return True

    def serve_one(self, peer: ShimPeer, dispatch: Dispatch) -> bool:
        """The peer's next ring message, dispatched; False when there is none (or a MARK waits)."""
        ident = peer.ident
        try:
            rings = peer.rings
            msg = rings.duplex.recv(self.codec.decode) if rings is not None and not rings.closed else EMPTY
        except FrameError as exc:
            self.send(ident, self.refuse(exc.code, str(exc), ident))
            return True
        except RingError as exc:
            self._drop(ident, "bad_ring", str(exc))
            return True
        if msg is EMPTY:
            return False
        if isinstance(msg, Hello):
            self.send(ident, self.refuse("unexpected", "Hello belongs on the socket, not in a ring", ident))
            return True
        dispatch(ident, msg)
        return True
