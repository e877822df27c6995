"""The sidecar daemon: a ZeroMQ ROUTER that answers shims and control clients.

Single-threaded on purpose: hook calls happen in step order, and the loop
never blocks on a peer. Every inbound frame is untrusted: size-capped,
schema-validated, and answered with an ErrorReply when rejected.

Shims that negotiated shared-memory rings (issue #6) send their step messages
through them. While any such session exists the loop polls every session ring
and the socket together: after its last message it keeps polling (with
sched_yield, so it gives the CPU away) for `ring_spin_us`, then raises each
ring's "sleeping" flag and blocks on the socket for at most `ring_sleep_ms`; a
shim that writes into a ring while the flag is up sends an empty "kick" frame.
The bounded sleep covers kicks lost to the missing store-load fence and keeps
signals, drains and heartbeats as prompt as before. After RING_IDLE_S without any
traffic the sleeps stretch to RING_IDLE_SLEEP_MS, so an idle sidecar (or one whose
shims went away: sessions are not reaped on disconnect) does not wake 500 times a
second; a kick lost right then (a race of nanoseconds) costs that much once. Garbage in a ring is
answered and counted like a bad frame; the session is then dropped (a broken
ring cannot be resynchronised) and other sessions are unaffected.
"""

from __future__ import annotations

import logging
import os
import secrets
import signal
import time

import msgspec
import torch
import zmq

from omni_sidecar import __version__
from omni_sidecar.hooks import OmniHooks
from omni_sidecar.metrics import SidecarMetrics
from omni_sidecar.security import (
    CurveServer,
    SecurityError,
    filter_peers,
    prepare_socket_dir,
    secure_socket_file,
)
from omni_sidecar.rings import EMPTY, RingLink, RingOverflow
from omni_sidecar.session import Session
from omni_sidecar.statepack import pack, unpack
from omni_sidecar.store import FinishedOutputs
from omni_sidecar.tensors import tensor_to_bytes
from proto.codec import Codec, FrameError
from proto.endpoint import check_endpoint, ipc_path, process_gone
from proto.messages import (
    Drain,
    Drained,
    ErrorReply,
    Hello,
    OutputChunk,
    OutputsQuery,
    SwitchAck,
    SwitchReady,
    Takeover,
    TakeoverState,
    OutputsReply,
    Ping,
    Pong,
    Reject,
    StatusQuery,
    StatusReply,
    StepBegin,
    StepEnd,
    StepPlan,
    StepResult,
    TensorBlob,
    Welcome,
)
from proto.arena import sweep_stale
from proto.shmring import RingError
from proto.version import PROTOCOL_MAJOR, PROTOCOL_MINOR, PROTOCOL_VERSION

log = logging.getLogger("omni_sidecar.server")
RING_IDLE_S = 1.0
REAP_INTERVAL_S = 2.0
RING_IDLE_SLEEP_MS = 50


class SidecarServer:
    def __init__(
        self,
        endpoint: str,
        hooks: OmniHooks,
        keep_finished: int = 10_000,
        max_frame_bytes: int = 64 << 20,
        arena_bytes: int = 0,
        metrics_port: int = 0,
        allowed_uids: list[int] | None = None,
        curve_keys: str | None = None,
        ring: bool = True,
        ring_spin_us: int = 2000,
        ring_sleep_ms: int = 2,
    ) -> None:
        check_endpoint(endpoint, curve_keys)
        # Shared-memory rings for step messages (see the module docstring).
        self.ring_enabled = ring
        self.ring_spin_s = ring_spin_us / 1e6
        self.ring_sleep_ms = max(1, int(ring_sleep_ms))
        self._links: dict[bytes, RingLink] = {}
        self._ring_busy_at = 0.0
        self.allowed_uids = allowed_uids or []
        self.curve_keys = curve_keys
        self._curve: CurveServer | None = None
        self.metrics = SidecarMetrics()
        self.metrics_port = metrics_port
        self.endpoint = endpoint
        self.hooks = hooks
        self.codec = Codec(max_frame_bytes)
        self.finished = FinishedOutputs(keep_finished)
        self.arena_bytes = arena_bytes
        self.sessions: dict[bytes, Session] = {}
        self._next_reap = 0.0
        self.rejected_frames = 0
        self.started = time.monotonic()
        self._next_session = 1
        self._stop = False
        self._draining = False
        self.drain_timeout_s = 10.0
        self._drain_deadline = 0.0
        self._last_step = 0.0
        self._reload_requested = False
        self.on_reload = None  # set by the CLI: re-reads the config on SIGHUP
        # Hot upgrade, old side: (successor's identity, its Takeover) once accepted.
        self._successor: tuple[bytes, Takeover] | None = None
        # Hot upgrade, new side: the socket to the predecessor and what it handed over.
        self._takeover_sock: zmq.Socket | None = None
        self._takeover_deadline = 0.0
        self._final_endpoint = ""
        self._resume: dict[str, dict | None] = {}
        self._waiting_hellos: list[tuple[bytes, Hello]] = []
        self.takeover_failed = ""
        self._bound: list[tuple[str, int]] = []  # (socket path, inode) this process bound
        self._ctx = zmq.Context.instance()
        self._sock: zmq.Socket | None = None

    # -- lifecycle -----------------------------------------------------------

    def bind(self) -> None:
        stale = sweep_stale()
        if stale:
            log.info("removed %d stale arena(s) left in /dev/shm by dead processes", len(stale))
        path = ipc_path(self.endpoint)
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
        # Frames over the cap get a clear error from the codec; libzmq drops the connection
        # only for frames past twice the cap, before they are ever buffered whole.
        sock.setsockopt(zmq.MAXMSGSIZE, 2 * self.codec.max_frame_bytes)
        sock.setsockopt(zmq.HEARTBEAT_IVL, 1000)  # libzmq pings idle peers; dead ones drop
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 3000)
        if path is not None:
            prepare_socket_dir(path)
            self._refuse_if_serving()
            if os.path.exists(path):
                os.unlink(path)  # a stale socket left by a dead sidecar
            filter_peers(sock, self.allowed_uids)
        else:
            self._curve = CurveServer(self._ctx, self.curve_keys or "")
            self._curve.apply(sock)
        self._bind_path(sock, self.endpoint)
        self._sock = sock
        if self.metrics_port:
            self.metrics.serve(self.metrics_port)
            log.info("Prometheus metrics on http://127.0.0.1:%d/metrics", self.metrics_port)
        log.info(
            "omni-sidecar %s listening on %s with hook set %r (needs %s); protocol %s",
            __version__, self.endpoint, self.hooks.name, self.hooks.needs, PROTOCOL_VERSION,
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
                len(self.sessions), self.drain_timeout_s,
            )

    def _request_reload(self, *_: object) -> None:
        self._reload_requested = True

    def _drained(self) -> bool:
        now = time.monotonic()
        return not self.sessions or now - self._last_step > 1.0 or now > self._drain_deadline

    def serve_forever(self, install_signals: bool = True) -> None:
        if self._sock is None:
            self.bind()
        if install_signals:
            signal.signal(signal.SIGTERM, self.begin_drain)
            signal.signal(signal.SIGINT, self.request_stop)
            signal.signal(signal.SIGHUP, self._request_reload)
        assert self._sock is not None
        # Block in recv (one wake-up per message); the timeout lets signals act promptly.
        self._sock.setsockopt(zmq.RCVTIMEO, 200)
        try:
            while not self._stop:
                self._reap_dead_shims()
                if self._reload_requested:
                    self._reload_requested = False
                    if self.on_reload is not None:
                        self.on_reload()
                if self._draining and self._drained():
                    break
                if self._takeover_sock is not None:
                    self._poll_takeover()
                    continue
                if self._links:
                    self._serve_rings_once()
                    continue
                try:
                    frames = self._recv_frames()
                except zmq.Again:
                    continue
                self._serve(frames)
        finally:
            self.close()

    def _reap_dead_shims(self) -> None:
        """End sessions whose vLLM worker process exited (checked every REAP_INTERVAL_S).

        Only possible when the shim runs in our PID namespace (same host or pod, not
        separate containers); otherwise sessions stay until the sidecar restarts.
        """
        now = time.monotonic()
        if now < self._next_reap:
            return
        self._next_reap = now + REAP_INTERVAL_S
        for ident, session in list(self.sessions.items()):
            hello = session.hello
            if not process_gone(hello.pid, hello.pid_namespace):
                continue
            live = session.abandon(f"the vLLM worker process (pid {hello.pid}) exited")
            self._close_link(ident)
            del self.sessions[ident]
            session.close()
            self.metrics.sessions.set(len(self.sessions))
            log.warning("session %d ended: its vLLM worker (pid %d) exited; %d live request(s) end "
                        "with an error, arenas and rings released", session.id, hello.pid, len(live))

    def _bind_path(self, sock: zmq.Socket, endpoint: str) -> None:
        old_umask = os.umask(0o077)
        try:
            sock.bind(endpoint)
        finally:
            os.umask(old_umask)
        path = ipc_path(endpoint)
        if path is not None:
            secure_socket_file(path)
            self._bound.append((path, os.stat(path).st_ino))

    def _refuse_if_serving(self) -> None:
        """Two sidecars on one socket would split a shim's traffic: refuse to start."""
        from omni_sidecar.client import SidecarClient, SidecarUnavailable

        path = ipc_path(self.endpoint)
        if path is None or not os.path.exists(path):
            return
        try:
            with SidecarClient(self.endpoint, timeout_s=0.3) as client:
                client.ping()
        except SidecarUnavailable:
            return
        raise SecurityError(
            f"another omni-sidecar is serving at {self.endpoint}; stop it first (SIGTERM drains it)"
        )

    def close(self) -> None:
        if self._curve is not None:
            self._curve.stop()
        for link in self._links.values():
            link.close()
        self._links.clear()
        for session in self.sessions.values():
            session.close()
        self.sessions.clear()
        if self._sock is not None:
            # Give last replies (a SwitchAck, the successor's state) a moment to leave.
            self._sock.close(linger=1000)
            self._sock = None
            for path, ino in self._bound:
                try:
                    if os.stat(path).st_ino == ino:
                        os.unlink(path)  # never a successor's socket that replaced ours
                except FileNotFoundError:
                    pass
        if self._takeover_sock is not None:
            self._takeover_sock.close(0)
        log.info("omni-sidecar stopped")

    # -- dispatch ------------------------------------------------------------

    def _recv_frames(self) -> list[bytes]:
        """[identity, body, extra frames...]; frame by frame, which is cheaper than recv_multipart."""
        sock = self._sock
        assert sock is not None
        frames = [sock.recv(), sock.recv()]  # ROUTER: an identity, then at least one frame
        while sock.rcvmore:
            frames.append(sock.recv())
        return frames

    def _serve(self, frames: list) -> None:
        link = self._links.get(frames[0])
        if link is not None:
            self._serve_link_frames(frames, link)
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
            reply = self._refuse("internal", f"{type(msg).__name__}: {exc!r}")
        if reply is not None:
            self._send(ident, reply)

    # -- shared-memory rings ---------------------------------------------------------

    def _serve_rings_once(self) -> None:
        """One loop turn while ring sessions exist: rings and socket, spin, then sleep."""
        sock = self._sock
        assert sock is not None
        busy = self._pump_rings()
        if sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            self._serve(self._recv_frames())
            busy = True
        now = time.monotonic()
        if busy:
            self._ring_busy_at = now
            return
        if now - self._ring_busy_at < self.ring_spin_s:
            os.sched_yield()  # poll again soon, but let vLLM's threads run first
            return
        links = list(self._links.values())
        for link in links:
            link.set_sleeping(True)
        try:
            if self._pump_rings():  # written before the writer could see our flags
                self._ring_busy_at = time.monotonic()
                return
            idle = now - self._ring_busy_at > RING_IDLE_S
            if sock.poll(max(self.ring_sleep_ms, RING_IDLE_SLEEP_MS) if idle else self.ring_sleep_ms):
                self._serve(self._recv_frames())  # a kick, or control traffic
        finally:
            for link in links:
                link.set_sleeping(False)

    def _pump_rings(self) -> bool:
        """At most one message per ring session (fair across sessions); True if any was served."""
        busy = False
        for ident, link in list(self._links.items()):
            if link.closed:
                continue
            if link.queue:
                self._flush_link(ident, link)
            busy |= self._serve_link_once(ident, link)
        return busy

    def _serve_link_frames(self, frames: list, link: RingLink) -> None:
        """A frame on the socket from a ring session: a kick, or the message behind a MARK."""
        ident = frames[0]
        if len(frames) == 2 and not frames[1]:
            return  # a kick: the loop reads the rings next
        if len(frames) != 2:
            self._reject(ident, "bad_envelope", f"expected 1 body frame, got {len(frames) - 1}")
            return
        link.duplex.feed_socket(frames[1])
        # Everything the shim put in the ring before it is older: serve up to and including it.
        while not link.closed and link.duplex.socket_frames:
            if not self._serve_link_once(ident, link):
                break

    def _serve_link_once(self, ident: bytes, link: RingLink) -> bool:
        try:
            msg = link.recv(self.codec.decode)
        except FrameError as exc:
            self._reject(ident, exc.code, str(exc))
            return True
        except RingError as exc:
            self._drop_link(ident, "bad_ring", str(exc))
            return True
        if msg is EMPTY:
            return False
        if isinstance(msg, Hello):
            self._reject(ident, "unexpected", "Hello belongs on the socket, not in a ring")
            return True
        self._dispatch(ident, msg)
        return True

    def _flush_link(self, ident: bytes, link: RingLink) -> None:
        try:
            link.flush(lambda frame: self._send_raw(ident, frame))
        except RingError as exc:
            self._drop_link(ident, "bad_ring", str(exc))

    def _drop_link(self, ident: bytes, code: str, message: str) -> None:
        """A ring we cannot trust any more: tell the shim (if we still can), end the session."""
        link = self._links.pop(ident, None)
        if link is None:
            return
        frame = self.codec.encode(self._refuse(code, f"{message}; session closed, reconnect"))
        try:
            link.send(frame, False, lambda f: self._send_raw(ident, f))
        except (RingError, RingOverflow):
            self._send_raw(ident, frame)  # unmarked: the shim drops the connection either way
        link.close()
        session = self.sessions.pop(ident, None)
        if session is not None:
            log.error("session %d dropped: %s", session.id, message)
            session.close()
            self.metrics.sessions.set(len(self.sessions))

    def _close_link(self, ident: bytes) -> None:
        link = self._links.pop(ident, None)
        if link is not None:
            link.close()

    def _open_rings(self, hello: Hello) -> RingLink | None:
        if not hello.rings or not self.ring_enabled:
            return None
        try:
            return RingLink.attach(list(hello.rings))
        except Exception as exc:  # not rings, gone, too big: this connection uses the socket
            log.warning("shim rank %d offered rings that cannot be used (%s); ZeroMQ only", hello.rank, exc)
            return None

    def _handle(self, ident: bytes, msg: object):
        if isinstance(msg, StepEnd | StepBegin):
            session = self.sessions.get(ident)
            if session is None:
                return self._refuse("no_session", "send Hello before step messages")
            self._last_step = time.monotonic()
            if isinstance(msg, StepBegin):
                return session.step_begin(msg)
            result = session.step_end(msg)
            if self._successor is not None:
                result = msgspec.structs.replace(result, switch_to=self._successor[1].new_endpoint)
            return result
        if isinstance(msg, Hello):
            return self._hello(ident, msg)
        if isinstance(msg, Ping):
            return Pong(msg.nonce)
        if isinstance(msg, StatusQuery):
            return self._status()
        if isinstance(msg, OutputsQuery):
            return self._outputs(msg)
        if isinstance(msg, Drain):
            self.begin_drain()
            return Drained(len(self.sessions))
        if isinstance(msg, Takeover):
            return self._accept_takeover(ident, msg)
        if isinstance(msg, SwitchReady):
            return self._switch(ident, msg)
        return self._refuse("unexpected", f"{type(msg).__name__} is not a request the sidecar serves")

    def _hello(self, ident: bytes, hello: Hello):
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
        if hello.resume_token:
            if hello.resume_token not in self._resume:
                if self._takeover_sock is not None:
                    self._waiting_hellos.append((ident, hello))  # the state is on its way
                    return None
                return Reject(f"unknown resume token {hello.resume_token!r}")
        old = self.sessions.pop(ident, None)
        self._close_link(ident)
        if old is not None:
            old.close()
            self.metrics.sessions.set(len(self.sessions))
        session = Session(
            self._next_session, hello, self.hooks, self.finished, self.arena_bytes, self.metrics
        )
        try:
            session.open_arenas()
        except Exception as exc:
            session.close()
            return Reject(f"cannot open the shim's arenas: {exc}")
        self._next_session += 1
        self.sessions[ident] = session
        link = self._open_rings(hello)
        if link is not None:
            self._links[ident] = link
        if hello.resume_token:
            doc = self._resume.pop(hello.resume_token)
            if doc is not None:
                session.import_(doc)
            log.info("session %d resumed %d request(s) handed over by the predecessor",
                     session.id, len(session.requests))
        self.metrics.sessions.set(len(self.sessions))
        log.info(
            "session %d: shim rank %d/%d, vLLM %s on %s, model %s",
            session.id, hello.rank, hello.world_size, hello.vllm_version, hello.platform, hello.model,
        )
        out = [session.out_arena.info()] if session.out_arena is not None else []
        return Welcome(
            protocol_major=PROTOCOL_MAJOR,
            protocol_minor=PROTOCOL_MINOR,
            sidecar_version=__version__,
            hook_set=self.hooks.name,
            needs=self.hooks.needs,
            session=session.id,
            arenas=out,
            consumer_events=session.consumer_events,
            rings=link is not None,
        )

    # -- hot upgrade, old side ------------------------------------------------------

    def _accept_takeover(self, ident: bytes, msg: Takeover):
        if self._successor is not None or self._draining:
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
        self._successor = (ident, msg)
        log.info("takeover accepted: %s (hook set %r) will take over; shims switch at their next step",
                 msg.new_endpoint, msg.hook_set)
        if not self.sessions:
            reply = self._hand_over(None)
            self.begin_drain()
            return reply
        return None  # TakeoverState goes out when the shim is at a step boundary

    def _switch(self, ident: bytes, msg: SwitchReady):
        session = self.sessions.get(ident)
        if session is None or self._successor is None:
            return self._refuse("no_switch", "no takeover in progress for this session")
        successor_ident, takeover = self._successor
        state = self._hand_over(session)
        self._send(successor_ident, state)
        del self.sessions[ident]
        session.close()
        self.metrics.sessions.set(len(self.sessions))
        log.info("session %d handed over at step %d to %s", session.id, msg.last_step, takeover.new_endpoint)
        self.begin_drain()
        # Through the session's rings (behind anything still queued there), then close them.
        self._send(ident, SwitchAck(endpoint=takeover.new_endpoint, token=state.token))
        self._close_link(ident)
        return None

    def _hand_over(self, session: Session | None) -> TakeoverState:
        doc = {
            "session": session.export() if session is not None else None,
            "hooks": self.hooks.export_state(),
            "finished": self.finished.export(),
        }
        return TakeoverState(
            hook_set=self.hooks.name, state_version=self.hooks.state_version,
            token=secrets.token_hex(8), state=pack(doc),
        )

    # -- hot upgrade, new side ------------------------------------------------------

    def start_takeover(self, old_endpoint: str, timeout_s: float) -> None:
        """Bound on a side socket already; ask the running sidecar to hand over."""
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(old_endpoint)
        sock.send(self.codec.encode(Takeover(
            new_endpoint=self.endpoint, sidecar_version=__version__, hook_set=self.hooks.name,
            accepts_state=list(self.hooks.accepts_state),
        )))
        self._takeover_sock = sock
        self._takeover_deadline = time.monotonic() + timeout_s
        self._final_endpoint = old_endpoint
        log.info("takeover: asked the sidecar at %s to hand over (waiting up to %.0f s)", old_endpoint, timeout_s)

    def _poll_takeover(self) -> None:
        assert self._sock is not None and self._takeover_sock is not None
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._takeover_sock, zmq.POLLIN)
        busy = self._pump_rings() if self._links else False
        ready = dict(poller.poll(0 if busy else self.ring_sleep_ms if self._links else 100))
        if self._sock in ready:
            self._serve(self._recv_frames())
        if self._takeover_sock in ready:
            self._finish_takeover(self._takeover_sock.recv())
        elif time.monotonic() > self._takeover_deadline:
            self._abort_takeover("the running sidecar did not hand over in time")

    def _finish_takeover(self, frame: bytes) -> None:
        try:
            msg = self.codec.decode(frame)
        except FrameError as exc:
            return self._abort_takeover(f"bad reply: {exc}")
        if isinstance(msg, Reject):
            return self._abort_takeover(msg.reason)
        if not isinstance(msg, TakeoverState):
            return self._abort_takeover(f"unexpected {type(msg).__name__}")
        doc = unpack(msg.state)
        self.hooks.import_state(doc.get("hooks") or {})
        self.finished.restore(doc.get("finished") or {})
        self._resume[msg.token] = doc.get("session")
        self._takeover_sock.close(0)  # type: ignore[union-attr]
        self._takeover_sock = None
        # Also answer at the usual address from now on: shims that reconnect later find us
        # there. The side address stays bound for the shim that is switching right now.
        final = ipc_path(self._final_endpoint)
        if final is not None:
            try:
                os.unlink(final)  # the predecessor's socket file; its own socket stays open
            except FileNotFoundError:
                pass
            assert self._sock is not None
            self._bind_path(self._sock, self._final_endpoint)
        log.info("takeover done: state of hook set %r (%s) imported; serving at %s",
                 msg.hook_set, msg.state_version, self.endpoint)
        waiting, self._waiting_hellos = self._waiting_hellos, []
        for ident, hello in waiting:
            self._send(ident, self._hello(ident, hello))

    def _abort_takeover(self, reason: str) -> None:
        self.takeover_failed = reason
        log.error("takeover refused: %s. The running sidecar keeps serving; this one exits.", reason)
        self._stop = True

    def _status(self) -> StatusReply:
        return StatusReply(
            sidecar_version=__version__,
            protocol=PROTOCOL_VERSION,
            hook_set=self.hooks.name,
            needs=self.hooks.needs,
            uptime_s=time.monotonic() - self.started,
            draining=self._draining,
            rejected_frames=self.rejected_frames,
            sessions=[s.status() for s in self.sessions.values()],
            pid=os.getpid(),
        )

    def _live_request(self, req_id: str) -> tuple[Session, str] | None:
        for session in self.sessions.values():
            found = session.resolve(req_id)
            if found is not None:
                return session, found
        return None

    def _outputs(self, q: OutputsQuery) -> OutputsReply:
        live = self._live_request(q.req_id)
        if live is not None:
            session, req_id = live
            outputs = self.hooks.get_outputs(req_id) if q.since < 0 else None
            chunks = self.hooks.output_chunks(req_id) if q.since >= 0 else None
            error = session.errors_by_request.get(req_id, "")
        else:
            entry = self.finished.get(q.req_id, q.pop)
            if entry is None:
                return OutputsReply(req_id=q.req_id, found=False)
            outputs, chunks, error = entry.outputs, entry.chunks, entry.error
        tensors, values = _split(outputs or {})
        out_chunks = []
        if q.since >= 0 and chunks:
            out_chunks = [OutputChunk(*_split(c)) for c in chunks[q.since :]]
        return OutputsReply(
            req_id=q.req_id,
            found=True,
            finished=live is None,
            tensors=tensors,
            values=values,
            chunks=out_chunks,
            cursor=max(q.since, 0) + len(out_chunks),
            error=error,
        )

    def _refuse(self, code: str, message: str) -> ErrorReply:
        """Count and log a rejected frame; the reply tells the sender why."""
        self.rejected_frames += 1
        self.metrics.rejected_frames.labels(code).inc()
        log.warning("rejected a frame (%s): %s", code, message)
        return ErrorReply(code, message[:4000])

    def _reject(self, ident: bytes, code: str, message: str) -> None:
        self._send(ident, self._refuse(code, message))

    def _send(self, ident: bytes, msg: object) -> None:
        frame = self.codec.encode(msg)
        link = self._links.get(ident)
        if link is None or isinstance(msg, Welcome | Reject):  # no rings (yet): the socket
            self._send_raw(ident, frame)
            return
        try:
            # Step replies and errors take the ring; control replies go behind a MARK.
            link.send(frame, not isinstance(msg, _RING_REPLIES), lambda f: self._send_raw(ident, f))
        except RingError as exc:
            self._drop_link(ident, "bad_ring", str(exc))
        except RingOverflow as exc:
            self._drop_link(ident, "ring_overflow", str(exc))

    def _send_raw(self, ident: bytes, frame: bytes) -> None:
        assert self._sock is not None
        try:
            self._sock.send(ident, zmq.SNDMORE | zmq.NOBLOCK)
            self._sock.send(frame, zmq.NOBLOCK)
        except zmq.Again:
            log.warning("dropped a reply: peer is not reading")


_RING_REPLIES = (StepPlan, StepResult, ErrorReply)


def _split(outputs: dict) -> tuple[dict[str, TensorBlob], dict]:
    """Tensors become blobs; JSON-like values travel as they are."""
    tensors, values = {}, {}
    for name, value in outputs.items():
        if isinstance(value, torch.Tensor):
            data, shape, dtype = tensor_to_bytes(value)
            tensors[name] = TensorBlob(shape, dtype, data)
        else:
            values[name] = value
    return tensors, values
