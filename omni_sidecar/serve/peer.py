"""One shim connection as the sidecar sees it: its session and its transport.

Every way a session ends goes through `ShimPeer.end(reason)`: the worker process
exited (reaper), the session moved to a successor (hot upgrade), the shim said
Hello again, the sidecar stops, or the rings broke.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Literal

from omni_sidecar.serve.listener import Listener
from omni_sidecar.sessions.session import Session
from proto.codec import Codec
from proto.errors import ProtoError
from proto.messages import Message, StepBegin, StepEnd, StepStart, StepTick, SwitchReady
from proto.shmring import EMPTY
from proto.transport import RingTransport, route

log = logging.getLogger("omni_sidecar.peer")

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
        how = route(msg)
        if how != "ring" or not rings.send_now(frame):  # send_now: a step reply's usual one write
            rings.send(frame, how)

    def flush(self) -> None:
        if self.rings is not None and self.rings.queued:
            self.rings.flush()

    def next_message(self, decode: Callable[[bytes | memoryview], object]) -> object:
        """The shim's next ring message in connection order, or EMPTY (FrameError, RingError)."""
        if self.rings is None or self.rings.closed:
            return EMPTY
        return self.rings.recv(decode)

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
