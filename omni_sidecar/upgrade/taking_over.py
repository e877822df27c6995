"""Hot upgrade, the taking-over side: a new sidecar asks the running one for its state and its shims.

Like Envoy's hot-restart child: bound on a side address, it sends a Takeover on the running
sidecar's socket, serves the rings and the socket meanwhile (a Hello with a resume token, or a
status query, that comes before the state waits for it), imports what comes back (the hooks'
state, the finished outputs, each session's state under a resume token until its shim says
Hello with that token), and then answers at the usual address too. The running side is
omni_sidecar/upgrade/handing_over.py; docs/ARCHITECTURE.md, Hot upgrade.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

import zmq

from omni_sidecar import __version__
from omni_sidecar.serve.peers import Dispatch
from omni_sidecar.upgrade.takeover_state import UpgradeParts, unpack
from proto.codec import Codec, FrameError
from proto.messages import Hello, Message, Reject, StatusReply, Takeover, TakeoverState

log = logging.getLogger("omni_sidecar.upgrade")
STATUS_ASKERS_MAX = 64  # status queries held until the takeover's state arrived
TAKEOVER_POLL_MS = 100

AnswerHello = Callable[[bytes, Hello, int], Message | None]  # the server's Hello handling, for those that waited


class TakingOver:
    """The successor's side, from its Takeover request until the state arrived (and the resume
    docs after it, until each shim claims its own)."""

    def __init__(self, parts: UpgradeParts, codec: Codec) -> None:
        self.hooks, self.finished, self.peers, self.listener = parts
        self.codec = codec
        self.sock: zmq.Socket | None = None  # to the running sidecar, while we wait for its state
        self.waiting = False  # for the state (`sock` open); an attribute: the serving loop reads it per ring message
        self.endpoint = ""  # ours (the side address)
        self.old_endpoint = ""
        self.failed = ""  # why the takeover was refused (this sidecar then exits)
        self._deadline = 0.0
        self._resume: dict[str, dict[str, Any] | None] = {}  # token -> a session's exported state
        self.waiting_hellos: list[tuple[bytes, Hello, int]] = []  # (ident, Hello, fd): came before their state
        self._status_askers: list[bytes] = []  # StatusQuery senders, answered once the state is ours

    def start(self, new_endpoint: str, old_endpoint: str, timeout_s: float) -> None:
        """Bound on a side address already: ask the sidecar at `old_endpoint` to hand over."""
        sock = self.listener.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(old_endpoint)
        sock.send(self.codec.encode(Takeover(
            new_endpoint=new_endpoint, sidecar_version=__version__, hook_set=self.hooks.name,
            accepts_state=list(self.hooks.accepts_state),
        )))
        self.sock, self.waiting = sock, True
        self.endpoint = new_endpoint
        self._deadline = time.monotonic() + timeout_s
        self.old_endpoint = old_endpoint
        log.info("takeover: asked the sidecar at %s to hand over (waiting up to %.0f s)", old_endpoint, timeout_s)

    def turn(self, dispatch: Dispatch, serve: Callable[[list[bytes]], None], ring_sleep_ms: int,
             answer_hello: AnswerHello, status: Callable[[], StatusReply]) -> None:
        """One turn of the serving loop while the state is on its way: the running sidecar's
        answer first, then the rings and the socket; `failed` says why when it was refused."""
        takeover_sock = self.sock
        assert takeover_sock is not None
        poller = zmq.Poller()
        poller.register(self.listener.sock, zmq.POLLIN)
        poller.register(takeover_sock, zmq.POLLIN)
        rings = bool(self.peers.ring_transports())
        busy = self.peers.pump(dispatch) if rings else False
        ready = dict(poller.poll(0 if busy else ring_sleep_ms if rings else TAKEOVER_POLL_MS))
        if takeover_sock in ready:  # first: a shim or client that reached us may have come after it
            failure = self._receive(takeover_sock.recv())
            if failure:
                self._abort(failure)
            else:
                self._took_over(answer_hello, status)
        elif time.monotonic() > self._deadline:
            self._abort("the running sidecar did not hand over in time")
        if self.listener.sock in ready:
            serve(self.listener.recv_frames())

    def _receive(self, frame: bytes) -> str:
        """The running sidecar's answer: import its state; "" when done, else why it failed."""
        try:
            msg = self.codec.decode(frame)
        except FrameError as exc:
            return f"bad reply: {exc}"
        if isinstance(msg, Reject):
            return msg.reason
        if not isinstance(msg, TakeoverState):
            return f"unexpected {type(msg).__name__}"
        doc = unpack(msg.state)
        self.hooks.import_state(doc.get("hooks") or {})
        self.finished.restore(doc.get("finished") or {})
        self._resume.update(doc.get("sessions") or {})
        self.close()
        log.info("takeover done: state of hook set %r (%s) imported", msg.hook_set, msg.state_version)
        return ""

    def _took_over(self, answer_hello: AnswerHello, status: Callable[[], StatusReply]) -> None:
        # Answer at the usual address (the side one stays bound for a shim switching right now).
        self.listener.replace_path(self.old_endpoint)
        log.info("serving at %s and %s", self.endpoint, self.old_endpoint)
        waiting, self.waiting_hellos = self.waiting_hellos, []
        for ident, hello, fd in waiting:
            reply = answer_hello(ident, hello, fd)
            if reply is not None:
                self.peers.send(ident, reply)
        askers, self._status_askers = self._status_askers, []
        for ident in askers:
            self.peers.send(ident, status())

    def _abort(self, reason: str) -> None:
        self.failed = reason
        log.error("takeover refused: %s. The running sidecar keeps serving; this one exits.", reason)
        self.close()

    def defer_status(self, ident: bytes) -> None:
        if len(self._status_askers) < STATUS_ASKERS_MAX:  # a client that floods us gets no answer
            self._status_askers.append(ident)

    def knows(self, token: str) -> bool:
        return token in self._resume

    def resume(self, token: str) -> dict[str, Any] | None:
        """The session state handed over under `token` (once)."""
        return self._resume.pop(token, None)

    def unclaimed(self) -> dict[str, Any]:
        """Resume docs no shim claimed (yet): forwarded on our own hand-over, so idle upgrades chain."""
        out, self._resume = self._resume, {}
        return out

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close(0)
            self.sock, self.waiting = None, False
