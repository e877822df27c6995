"""Which sidecar the link talks to: loss, reconnect and hot-upgrade switch as one small state machine.

    connected --peer gone / step error--> lost      (requests fail per loss policy)
    lost      --Welcome on a fresh conn-> connected (reconnects += 1)
    connected --StepResult.switch_to----> switching (a successor asked for the session)
    switching --next step boundary------> connected (switches += 1), or lost if the switch fails
    connected/switching --SwitchAck kept--> connected at the next step boundary, no SwitchReady
              (the old sidecar handed the idle session over already and may have exited;
              kept before the step, or found in answer to this step's StepStart)

Liveness: a sidecar that dies (socket monitor), stalls past the step timeout,
or sends garbage is dropped at once; vLLM keeps serving. The requests it was
serving fail explicitly (logged, in `omni_sidecar_stats`, and reported to the
next sidecar so clients get `RequestFailed`); which others fail meanwhile is
the `loss_policy`. The shim reconnects in the background (a Hello waits in
the socket until a sidecar binds) and switches over at a step boundary, or
between steps when asked (`SidecarLink.reconnect_idle`: an idle engine runs no
step, and the failures wait for the next sidecar).

The link's steady step never calls in here: it enters only when its port reports a
loss or a hand-over, at a step boundary (no port, a kept SwitchAck, a result's
`switch_to`, the peer gone: `at_step_start`) or where a step message failed (`fail`,
`announce_failed`). Transitions run only there.

Hand-over in the middle of a step: a StepStart sent after a quiet spell asks for an
answer, taken at the step's one wait. When a SwitchAck comes instead, the sidecar
handed the session over before it read anything of this step: the step's notices
go back in the queue, the shim switches and announces the step to the successor,
and `fail` returns the successor, where the link runs the step's exchange again.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Literal

import msgspec

from proto.messages import SwitchAck, SwitchReady
from proto.settings import STEP_START_ANSWER_S
from worker_shim.errors import SidecarError
from worker_shim.config import LossPolicy
from worker_shim.session.requests import FailureReports, SessionRequests
from worker_shim.step.port import Connect, RecoveryPort

log = logging.getLogger("vllm.omni_sidecar.shim.recovery")
RETRY_AFTER_S = 10.0
RECONNECT_WAIT_MS = 200
IDLE_RECONNECT_WAIT_MS = 1000  # between steps, a sidecar known to answer: its Welcome within this
MIN_SWITCH_CONNECT_S = 5.0

RecoveryState = Literal["connected", "lost", "switching"]
# What a step message's failure may be: the channel's error, a batch or tree the wire cannot carry.
STEP_FAILURES = (SidecarError, ValueError, msgspec.ValidationError)


def socket_identity(endpoint: str) -> tuple[int, int] | None:
    """(inode, mtime) of the sidecar's socket file: a new sidecar binds a new one."""
    try:
        st = os.stat(endpoint[len("ipc://"):])
    except (OSError, ValueError):
        return None
    return st.st_ino, st.st_mtime_ns


class Recovery:
    """Holds the current connection (`conn`, None while lost) and replaces it when it must."""

    def __init__(self, connect: Connect, first: RecoveryPort, requests: SessionRequests,
                 failures: FailureReports, loss_policy: LossPolicy = "fail-all") -> None:
        self._connect = connect  # makes a fresh connection (new socket, new arena)
        self.conn: RecoveryPort | None = first
        self._pending: RecoveryPort | None = None  # a reconnect attempt waiting for its Welcome
        self._waited_sockets: set[tuple[int, int]] = set()
        self.requests = requests
        self.failures = failures
        self.loss_policy = loss_policy
        self.losses = 0
        self.reconnects = 0
        self.switches = 0
        self.switch_us: list[float] = []  # stall of each hot-upgrade switch

    @property
    def state(self) -> RecoveryState:
        if self.conn is None:
            return "lost"
        return "switching" if self.conn.channel.switch_to else "connected"

    def at_step_start(self, step: int) -> None:
        """A step boundary where the port reported a loss or a hand-over (or there is none): the one
        place a connection is replaced. Then the step is announced to whichever sidecar serves it."""
        conn = self.conn
        if conn is None:
            self._try_reconnect()
            self.announce(step)
            return
        gone = conn.channel.switch_ack is None and conn.channel.peer_gone()
        if self._handed_over(gone):  # before a loss: the old sidecar may have exited since
            self._switch(step)
        elif self.conn is None:
            pass  # reading the old sidecar's last messages failed: lost just now
        elif self.state == "switching":  # also when the results just read asked for it
            self._switch(step)
        elif gone:
            self.lose("the sidecar closed the connection (it crashed, was killed or stopped)")
        self.announce(step)

    def announce(self, step: int) -> None:
        """The StepStart of `step` to the sidecar serving it (if any); a failure is `announce_failed`'s."""
        conn = self.conn
        if conn is None:
            return
        try:
            conn.announce_step(step, STEP_START_ANSWER_S)
        except SidecarError as exc:
            self.announce_failed(step, exc, conn)

    def announce_failed(self, step: int, exc: SidecarError, conn: RecoveryPort) -> None:
        """The StepStart of `step` to `conn` failed: handed over while we were quiet, before it read
        our StepStart (a SwitchAck came), the step goes to the successor; otherwise lost."""
        if conn is not self.conn:
            return  # replaced meanwhile
        if conn.channel.switch_ack is None:
            self.lose(f"step {step}: {exc}")
            return
        self._switch(step)
        if self.conn is not None:
            self.announce(step)

    def fail(self, step: int, exc: Exception, conn: RecoveryPort) -> RecoveryPort | None:
        """A message of `step` to `conn` failed; returns the sidecar that serves the rest of the step
        (None: lost). When the session was handed over before the sidecar read this step (a
        SwitchAck came, the StepStart's answer did not), the step's notices go back in the queue
        and the successor takes over, the step announced to it: the step's exchange runs again
        there. Otherwise the sidecar is lost (a send that failed may still be queued: asking
        again could send the step twice)."""
        if conn is not self.conn:
            return self.conn  # replaced meanwhile
        channel = conn.channel
        if isinstance(exc, SidecarError) and channel.switch_ack is not None and channel.pongs_due > 0:
            self.requests.notices.requeue_step()
            self._switch(step)  # a failed switch loses it: finish notices stay queued, the rest ended
            self.announce(step)
            return self.conn
        self.lose(f"step {step}: {exc}")
        return None

    def flush(self) -> None:
        """Wait until the sidecar handled every step sent so far: the results of the StepEnds;
        StepTicks sent since are unanswered, so one Ping behind them (docs/ARCHITECTURE.md, Step
        sequence). A session handed over while idle is left to the next step, which switches."""
        conn = self.conn
        if conn is None or conn.last_sent_step < 0:
            return
        try:
            if conn.last_answered_step >= 0:
                self.failures.note_results(conn.channel.take_results(until_step=conn.last_answered_step))
            if conn.last_sent_step > conn.last_answered_step and conn.channel.switch_ack is None:
                conn.sync()
        except SidecarError as exc:
            if conn.channel.switch_ack is None:
                self.lose(f"flush: {exc}")

    def reconnect_now(self) -> bool:
        """Lost and requests arrive: try the reconnect before they are refused (an idle vLLM runs
        no step, so the first requests after a sidecar came back arrive before the step that would
        reconnect). True when connected."""
        if self.state == "lost":
            self._try_reconnect()
        return self.conn is not None

    def drop_if_gone(self) -> None:
        """Between steps: a sidecar that went away while vLLM idled is lost now (as the next step
        would find it), unless it handed the session over first (the next step switches)."""
        conn = self.conn
        if conn is None or conn.channel.switch_ack is not None or conn.channel.switch_to:
            return
        if (conn.channel.peer_gone() and not self._handed_over(True) and self.conn is not None
                and self.state != "switching"):  # its last results asked for a switch: the next step makes it
            self.lose("the sidecar closed the connection (it crashed, was killed or stopped)")

    def reconnect_waiting(self, wait_ms: int) -> bool:
        """Lost, between steps, with a sidecar that answers there (its supervisor says so): wait up to
        `wait_ms` for its Welcome. A Hello still unanswered then never reached it (the attempt's
        connection broke before the sidecar bound, or a step already waited for this socket): one
        fresh attempt, waited for alike. True when connected."""
        for _ in range(2):
            if self.state != "lost":
                break
            self._try_reconnect(wait_ms)
            if self.conn is None and self._pending is not None:
                self._pending.close()
                self._pending = None
        return self.conn is not None

    def refuse(self, req_id: str, has_payload: bool) -> None:
        """A request vLLM admitted while no sidecar was connected: fail it if the policy says so."""
        if self.loss_policy == "fail-all" or has_payload:
            self.failures.fail(req_id, "no omni-sidecar was connected when the request arrived")

    # -- transitions -------------------------------------------------------------------

    def lose(self, reason: str) -> None:
        conn, self.conn = self.conn, None
        if conn is None:
            return
        self.losses += 1
        message = f"omni-sidecar lost ({reason}); its hooks did not run for this request"
        affected = self.requests.end_session(self.loss_policy)
        for req_id in affected:
            self.failures.fail(req_id, message)
        ident = socket_identity(conn.endpoint)
        if ident is not None:
            self._waited_sockets.add(ident)  # the dead sidecar's socket: do not wait on it
        log.error(
            "omni-sidecar at %s lost: %s. vLLM keeps serving; %d request(s) fail with a clear "
            "error (policy %s); reconnecting in the background (start a sidecar there).",
            conn.endpoint, reason, len(affected), self.loss_policy,
        )
        conn.close()

    def _handed_over(self, gone: bool) -> bool:
        """Did the sidecar hand this session over unasked? Its SwitchAck is read with the step's
        StepStart answer (a hand-over needs a quiet spell, after which the shim waits for that
        answer), or here when the old sidecar has exited since (`gone`)."""
        if gone:
            try:
                self.failures.note_results(self.conn.channel.take_results())
            except SidecarError as exc:
                self.lose(str(exc))
                return False
        return self.conn.channel.switch_ack is not None

    def _switch(self, step: int) -> None:
        """Hot upgrade at a step boundary: the old sidecar hands over, the new one resumes."""
        old = self.conn
        target = old.channel.switch_to
        t0 = time.perf_counter()
        try:
            ack: SwitchAck = old.channel.switch_ack or old.call(
                SwitchReady(last_step=old.last_sent_step, mirror_seq=old.mirror_seq), SwitchAck)
            self.failures.note_results(old.channel.take_results())
            new = self._resume(ack, timeout_s=max(MIN_SWITCH_CONNECT_S, old.step_timeout_s))
        except (SidecarError, ValueError) as exc:
            self.lose(f"switching to the new sidecar at {target} failed: {exc}")
            return
        old.close()
        self.conn = new
        self.switches += 1
        stall = (time.perf_counter() - t0) * 1e6
        self.switch_us.append(stall)
        log.warning("omni-sidecar hot upgrade: switched to %s (hook set %r) in %.1f ms at step %d",
                    ack.endpoint, new.hook_set, stall / 1e3, step)

    def _resume(self, ack: SwitchAck, timeout_s: float) -> RecoveryPort:
        """Connect with the resume token. An idle shim may switch while the address changes hands
        (a later upgrade: the sidecar holding our state forwards it and refuses us); when the
        socket there is a new one after a refusal, ask once more."""
        for attempt in (1, 2):
            socket_before = socket_identity(ack.endpoint)
            new = self._connect(endpoint=ack.endpoint, resume_token=ack.token)
            try:
                new.connect(timeout_s=timeout_s)
                return new
            except SidecarError:
                if attempt == 2 or socket_identity(ack.endpoint) in (socket_before, None):
                    raise
        raise AssertionError("unreachable")

    def _try_reconnect(self, wait_ms: int | None = None) -> None:
        pending = self._pending
        if pending is None:
            try:
                pending = self._pending = self._connect()
                pending.start()
            except Exception as exc:  # e.g. no room for a new arena: try again later
                log.error("omni-sidecar reconnect attempt failed: %s", exc)
                self._pending = None
                return
        # A freshly bound sidecar answers within milliseconds: wait that long, once per new
        # socket, and never for the dead sidecar's leftover socket file (`wait_ms`: as long as asked).
        if wait_ms is None:
            ident = socket_identity(pending.endpoint)
            wait = ident is not None and ident not in self._waited_sockets
            if wait:
                self._waited_sockets.add(ident)
            wait_ms = RECONNECT_WAIT_MS if wait else 0
        try:
            ready = pending.poll(wait_ms)
        except (SidecarError, ValueError) as exc:
            log.error("omni-sidecar refused the reconnect: %s", exc)
            pending.close()
            self._pending = None
            return
        if ready:
            self.conn, self._pending = pending, None
            self.reconnects += 1
            log.warning(
                "omni-sidecar reconnected at %s: hook set %r, session %d; %d failed request(s) "
                "reported to it", pending.endpoint, pending.hook_set, pending.welcome.session,
                len(self.failures.pending),
            )
        elif pending.channel.peer_gone() or time.monotonic() - pending.started > RETRY_AFTER_S:
            # Unanswered: a Hello sent to a sidecar that went away before answering is lost with its
            # connection (ZeroMQ does not send it again to the next one), so a fresh socket and arena
            # next time; one that never connected is tried again after the retry window.
            pending.close()
            self._pending = None

    def close(self) -> None:
        for conn in (self.conn, self._pending):
            if conn is not None:
                conn.close()
        self.conn = self._pending = None
