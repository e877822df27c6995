"""Hot upgrade: a new sidecar takes the hook state and the shims over from the running one.

Two small objects, like Envoy's hot-restart parent and child:
- `HandOver` (the running sidecar): accepts one successor's Takeover and packs,
  once, the state its sessions leave behind (each session under a resume token,
  the hooks' state, the finished outputs). Idle sessions go at once (their shims
  get an unsolicited SwitchAck); a busy one is told with its next StepResult and
  goes at its step boundary.
- `TakeOver` (the successor): asks the running sidecar to hand over, imports
  what comes back, keeps each session's state under a resume token until its
  shim says Hello with that token, and then answers at the usual address too.
"""

from __future__ import annotations

import logging
import secrets
import time
from typing import Any

import zmq

from omni_sidecar import __version__
from omni_sidecar.hooks import OmniHooks
from omni_sidecar.session import Session
from omni_sidecar.statepack import pack, unpack
from omni_sidecar.store import FinishedOutputs
from proto.codec import Codec, FrameError
from proto.messages import Hello, Reject, Takeover, TakeoverState

log = logging.getLogger("omni_sidecar.upgrade")
STATUS_ASKERS_MAX = 64  # status queries held until the takeover's state arrived


class HandOver:
    """The running sidecar's side: at most one successor at a time."""

    def __init__(self, hooks: OmniHooks, finished: FinishedOutputs) -> None:
        self.hooks = hooks
        self.finished = finished
        self.successor: bytes | None = None  # its identity on our socket
        self.switch_to = ""  # its endpoint, told to every shim with a StepResult
        self.handed = False  # the one TakeoverState went out: the successor reads only one

    @property
    def pending(self) -> bool:
        """A successor waits for the state."""
        return self.successor is not None and not self.handed

    def accept(self, ident: bytes, msg: Takeover, busy: bool) -> Reject | None:
        """Reject, or None when the successor is accepted (`busy`: a takeover or drain is on)."""
        if self.successor is not None or busy:
            return Reject("a takeover or drain is already in progress")
        mine = self.hooks.state_version
        if mine not in msg.accepts_state:
            log.error("refused takeover by %s (%s): it accepts %s, this sidecar keeps %r; still serving",
                      msg.new_endpoint, msg.hook_set, msg.accepts_state, mine)
            return Reject(
                f"incompatible hook state: the running sidecar's hook set {self.hooks.name!r} keeps state "
                f"{mine!r}, the new hook set {msg.hook_set!r} accepts {list(msg.accepts_state)}; "
                "nothing switched, the running sidecar keeps serving"
            )
        self.successor, self.switch_to = ident, msg.new_endpoint
        log.info("takeover accepted: %s (hook set %r) will take over; shims switch at their next step",
                 msg.new_endpoint, msg.hook_set)
        return None

    def state(self, sessions: dict[str, Session], forwarded: dict[str, Any]) -> TakeoverState:
        """All the successor needs, once: each session's export under a fresh resume token
        (the keys of `sessions`), plus resume docs this sidecar was handed and nobody claimed."""
        self.handed = True
        exported = dict(forwarded)
        exported.update((token, session.export()) for token, session in sessions.items())
        doc = {"sessions": exported, "hooks": self.hooks.export_state(), "finished": self.finished.export()}
        return TakeoverState(hook_set=self.hooks.name, state_version=self.hooks.state_version,
                             token="", state=pack(doc))

    @staticmethod
    def new_token() -> str:
        return secrets.token_hex(8)


class TakeOver:
    """The successor's side, from its Takeover request until the state arrived."""

    def __init__(self, hooks: OmniHooks, finished: FinishedOutputs, codec: Codec) -> None:
        self.hooks = hooks
        self.finished = finished
        self.codec = codec
        self.sock: zmq.Socket | None = None  # to the running sidecar, while we wait for its state
        self.old_endpoint = ""
        self._deadline = 0.0
        self._resume: dict[str, dict[str, Any] | None] = {}  # token -> a session's exported state
        self.waiting_hellos: list[tuple[bytes, Hello, int]] = []  # (ident, Hello, fd): came before their state
        self._status_askers: list[bytes] = []  # StatusQuery senders, answered once the state is ours

    @property
    def waiting(self) -> bool:
        return self.sock is not None

    def start(self, ctx: zmq.Context, new_endpoint: str, old_endpoint: str, timeout_s: float) -> None:
        """Bound on a side address already: ask the sidecar at `old_endpoint` to hand over."""
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(old_endpoint)
        sock.send(self.codec.encode(Takeover(
            new_endpoint=new_endpoint, sidecar_version=__version__, hook_set=self.hooks.name,
            accepts_state=list(self.hooks.accepts_state),
        )))
        self.sock = sock
        self._deadline = time.monotonic() + timeout_s
        self.old_endpoint = old_endpoint
        log.info("takeover: asked the sidecar at %s to hand over (waiting up to %.0f s)", old_endpoint, timeout_s)

    def expired(self) -> bool:
        return time.monotonic() > self._deadline

    def receive(self, frame: bytes) -> str:
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

    def defer_status(self, ident: bytes) -> None:
        if len(self._status_askers) < STATUS_ASKERS_MAX:  # a client that floods us gets no answer
            self._status_askers.append(ident)

    def take_status_askers(self) -> list[bytes]:
        out, self._status_askers = self._status_askers, []
        return out

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
            self.sock = None
