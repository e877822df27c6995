"""The serving loop's hot-upgrade turns (docs/ARCHITECTURE.md, Hot upgrade).

A mixin of omni_sidecar/server.py's `SidecarServer`, kept apart as its own concern: what the loop
does while a takeover is on. The old side hands its sessions over once each is between steps (or
said SwitchReady) and then drains; the new side polls the running sidecar for the state, then
answers the Hellos and status queries that came before it. The state itself (tokens, export,
import) is omni_sidecar/upgrade.py's `HandOver` and `TakeOver`.
"""

from __future__ import annotations

import logging

import zmq

from proto.messages import SwitchAck, SwitchReady
from proto.settings import IDLE_HANDOVER_S

log = logging.getLogger("omni_sidecar.server")  # the serving loop's records, under one name
TAKEOVER_POLL_MS = 100


class UpgradeLoop:
    """Needs the server's `endpoint`, `peers`, `listener`, `handover`, `takeover`, `queries`, `rejects`,
    `wait`, `takeover_failed`, `_draining`, `_stop`, `_dispatch`, `_serve`, `_serve_socket`, `_hello`
    and `begin_drain`."""

    def _hand_over_ready(self) -> None:
        """Hand all sessions over once each is between steps or after SwitchReady (docs/ARCHITECTURE.md, Hot upgrade)."""
        if not self.peers.drain(self._dispatch, lambda: self._serve_socket(0)) or not self.handover.pending:
            return  # first read all the shims wrote before now: still coming, decide on a later turn
        ready = self.peers.idle(IDLE_HANDOVER_S)
        if len(ready) == len(self.peers):
            self._hand_over(ready)

    def _switch(self, ident: bytes, msg: SwitchReady):
        peer = self.peers.get(ident)
        if peer is None or not self.handover.pending:
            return self.rejects.refuse("no_switch", "no takeover in progress for this session", ident)
        log.info("session %d at its step boundary (step %d)", peer.session.id, msg.last_step)
        peer.note_switch_ready(msg)  # its SwitchAck goes out with the hand-over, on this loop's next turn
        return None

    def _hand_over(self, idents: list[bytes]) -> None:
        """One TakeoverState with these sessions (and resume docs nobody claimed here); each shim
        gets its SwitchAck, unsolicited when it is idle (it switches at its next step)."""
        tokens = {ident: self.handover.new_token() for ident in idents}
        sessions = {token: self.peers.get(ident).session for ident, token in tokens.items()}
        assert self.handover.successor is not None
        usual = self.takeover.old_endpoint or self.endpoint  # outlives later upgrades; the successor's from now
        self.listener.give_path(self.handover.switch_to, usual)
        self.peers.send(self.handover.successor, self.handover.state(sessions, self.takeover.unclaimed()))
        for ident, token in tokens.items():
            log.info("session %d handed over to %s", self.peers.get(ident).session.id, self.handover.switch_to)
            # Through the session's rings (behind anything still queued there), then close them.
            self.peers.end(ident, "handed_over", farewell=SwitchAck(endpoint=usual, token=token))
        self.begin_drain()

    def start_takeover(self, old_endpoint: str, timeout_s: float) -> None:
        """Bound on a side address already; ask the running sidecar to hand over."""
        self.takeover.start(self.listener.ctx, self.endpoint, old_endpoint, timeout_s)

    def _poll_takeover(self) -> None:
        takeover_sock = self.takeover.sock
        assert takeover_sock is not None
        poller = zmq.Poller()
        poller.register(self.listener.sock, zmq.POLLIN)
        poller.register(takeover_sock, zmq.POLLIN)
        rings = bool(self.peers.ring_transports())
        busy = self.peers.pump(self._dispatch) if rings else False
        ready = dict(poller.poll(0 if busy else self.wait.sleep_ms if rings else TAKEOVER_POLL_MS))
        if takeover_sock in ready:  # first: a shim or client that reached us may have come after it
            failure = self.takeover.receive(takeover_sock.recv())
            if failure:
                self._abort_takeover(failure)
            else:
                self._took_over()
        elif self.takeover.expired():
            self._abort_takeover("the running sidecar did not hand over in time")
        if self.listener.sock in ready:
            self._serve(self.listener.recv_frames())

    def _took_over(self) -> None:
        # Answer at the usual address (the side one stays bound for a shim switching right now).
        self.listener.replace_path(self.takeover.old_endpoint)
        log.info("serving at %s and %s", self.endpoint, self.takeover.old_endpoint)
        waiting, self.takeover.waiting_hellos = self.takeover.waiting_hellos, []
        for ident, hello, fd in waiting:
            reply = self._hello(ident, hello, fd)
            if reply is not None:
                self.peers.send(ident, reply)
        for ident in self.takeover.take_status_askers():
            self.peers.send(ident, self.queries.status(self._draining, self.rejects.total))

    def _abort_takeover(self, reason: str) -> None:
        self.takeover_failed = reason
        log.error("takeover refused: %s. The running sidecar keeps serving; this one exits.", reason)
        self._stop = True
