"""Hot upgrade, the handing-over side: the running sidecar gives its state and its shims to a successor.

Like Envoy's hot-restart parent: it accepts one successor's Takeover (its hook set must accept
our state's layout), then, once every session is between steps (or its shim said SwitchReady),
packs once the state its sessions leave behind (each session under a resume token, the hooks'
state, the finished outputs) and sends it. Idle shims get an unsolicited SwitchAck and switch at
their next step; a busy one is told with its next StepResult and goes at its step boundary. Then
this sidecar drains. The successor's side is omni_sidecar/upgrade/taking_over.py;
docs/ARCHITECTURE.md, Hot upgrade.
"""

from __future__ import annotations

import logging
import secrets
from typing import Any, Callable

from omni_sidecar.serve.peers import Dispatch, Refuse
from omni_sidecar.sessions.session import Session
from omni_sidecar.upgrade.takeover_state import UpgradeParts, pack
from proto.messages import ErrorReply, Reject, SwitchAck, SwitchReady, Takeover, TakeoverState
from proto.settings import IDLE_HANDOVER_S

log = logging.getLogger("omni_sidecar.upgrade")
loop_log = logging.getLogger("omni_sidecar.server")  # the serving loop's records, under one name


class HandingOver:
    """The running sidecar's side: at most one successor at a time."""

    def __init__(self, parts: UpgradeParts, refuse: Refuse) -> None:
        self.hooks, self.finished, self.peers, self.listener = parts
        self.refuse = refuse
        self.successor: bytes | None = None  # its identity on our socket
        self.switch_to = ""  # its endpoint, told to every shim with a StepResult
        # A successor waits for the state (the one TakeoverState, which it reads once, not yet sent).
        # An attribute: the serving loop reads it after every ring message.
        self.pending = False

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
        self.successor, self.switch_to, self.pending = ident, msg.new_endpoint, True
        log.info("takeover accepted: %s (hook set %r) will take over; shims switch at their next step",
                 msg.new_endpoint, msg.hook_set)
        return None

    def switch_ready(self, ident: bytes, msg: SwitchReady) -> ErrorReply | None:
        """A shim at its step boundary waits for its SwitchAck: it goes out with the hand-over, on a
        later turn of the loop."""
        peer = self.peers.get(ident)
        if peer is None or not self.pending:
            return self.refuse("no_switch", "no takeover in progress for this session", ident)
        loop_log.info("session %d at its step boundary (step %d)", peer.session.id, msg.last_step)
        peer.note_switch_ready(msg)
        return None

    def turn(self, dispatch: Dispatch, serve_socket: Callable[[], bool], endpoint: str,
             forwarded: Callable[[], dict[str, Any]]) -> bool:
        """One turn of the serving loop while the successor waits: hand all sessions over once each
        is between steps or said SwitchReady (True: handed over, the sidecar drains now).
        `endpoint`: the address shims know us by; `forwarded`: resume docs handed to us that no shim
        claimed, passed on so idle upgrades chain."""
        if not self.peers.drain(dispatch, serve_socket) or not self.pending:
            return False  # first read all the shims wrote before now: still coming, decide on a later turn
        ready = self.peers.idle(IDLE_HANDOVER_S)
        if len(ready) != len(self.peers):
            return False
        self._hand_over(ready, endpoint, forwarded())
        return True

    def _hand_over(self, idents: list[bytes], endpoint: str, forwarded: dict[str, Any]) -> None:
        """One TakeoverState with these sessions (and the forwarded resume docs); each shim gets its
        SwitchAck, unsolicited when it is idle (it switches at its next step)."""
        tokens = {ident: secrets.token_hex(8) for ident in idents}
        sessions = {token: self.peers.get(ident).session for ident, token in tokens.items()}
        assert self.successor is not None
        self.listener.give_path(self.switch_to, endpoint)  # the usual address is the successor's from now
        self.peers.send(self.successor, self._state(sessions, forwarded))
        for ident, token in tokens.items():
            loop_log.info("session %d handed over to %s", self.peers.get(ident).session.id, self.switch_to)
            # Through the session's rings (behind anything still queued there), then close them.
            self.peers.end(ident, "handed_over", farewell=SwitchAck(endpoint=endpoint, token=token))

    def _state(self, sessions: dict[str, Session], forwarded: dict[str, Any]) -> TakeoverState:
        """All the successor needs, once: each session's export under its resume token (the keys
        of `sessions`), plus the forwarded resume docs."""
        self.pending = False
        exported = dict(forwarded)
        exported.update((token, session.export()) for token, session in sessions.items())
        doc = {"sessions": exported, "hooks": self.hooks.export_state(), "finished": self.finished.export()}
        return TakeoverState(hook_set=self.hooks.name, state_version=self.hooks.state_version,
                             token="", state=pack(doc))
