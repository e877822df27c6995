"""The sidecar daemon: a ZeroMQ ROUTER that answers shims and control clients.

Single-threaded on purpose: hook calls happen in step order, and the loop
never blocks on a peer. Every inbound frame is untrusted: size-capped,
schema-validated, and answered with an ErrorReply when rejected.
"""

from __future__ import annotations

import logging
import os
import signal
import time

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
from omni_sidecar.session import Session
from omni_sidecar.store import FinishedOutputs
from omni_sidecar.tensors import tensor_to_bytes
from proto.codec import Codec, FrameError
from proto.endpoint import check_endpoint, ipc_path
from proto.messages import (
    Drain,
    Drained,
    ErrorReply,
    Hello,
    OutputChunk,
    OutputsQuery,
    OutputsReply,
    Ping,
    Pong,
    Reject,
    StatusQuery,
    StatusReply,
    StepBegin,
    StepEnd,
    TensorBlob,
    Welcome,
)
from proto.version import PROTOCOL_MAJOR, PROTOCOL_MINOR, PROTOCOL_VERSION

log = logging.getLogger("omni_sidecar.server")


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
    ) -> None:
        check_endpoint(endpoint, curve_keys)
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
        self._ctx = zmq.Context.instance()
        self._sock: zmq.Socket | None = None

    # -- lifecycle -----------------------------------------------------------

    def bind(self) -> None:
        path = ipc_path(self.endpoint)
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
        # Frames over the cap get a clear error from the codec; libzmq drops the connection
        # only for frames past twice the cap, before they are ever buffered whole.
        sock.setsockopt(zmq.MAXMSGSIZE, 2 * self.codec.max_frame_bytes)
        if path is not None:
            prepare_socket_dir(path)
            self._refuse_if_serving()
            if os.path.exists(path):
                os.unlink(path)  # a stale socket left by a dead sidecar
            filter_peers(sock, self.allowed_uids)
        else:
            self._curve = CurveServer(self._ctx, self.curve_keys or "")
            self._curve.apply(sock)
        old_umask = os.umask(0o077)
        try:
            sock.bind(self.endpoint)
        finally:
            os.umask(old_umask)
        if path is not None:
            secure_socket_file(path)
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
                if self._reload_requested:
                    self._reload_requested = False
                    if self.on_reload is not None:
                        self.on_reload()
                if self._draining and self._drained():
                    break
                try:
                    frames = self._sock.recv_multipart()
                except zmq.Again:
                    continue
                self._serve(frames)
        finally:
            self.close()

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
        for session in self.sessions.values():
            session.close()
        self.sessions.clear()
        if self._sock is not None:
            self._sock.close(0)
            self._sock = None
            path = ipc_path(self.endpoint)
            if path and os.path.exists(path):
                os.unlink(path)
        log.info("omni-sidecar stopped")

    # -- dispatch ------------------------------------------------------------

    def _serve(self, frames: list) -> None:
        if len(frames) != 2:
            self._reject(frames[0], "bad_envelope", f"expected 1 body frame, got {len(frames) - 1}")
            return
        ident, body = frames
        try:
            msg = self.codec.decode(body)
        except FrameError as exc:
            self._reject(ident, exc.code, str(exc))
            return
        try:
            reply = self._handle(ident, msg)
        except Exception as exc:  # never let one peer's frame stop the server
            log.exception("error handling %s", type(msg).__name__)
            reply = self._refuse("internal", f"{type(msg).__name__}: {exc!r}")
        if reply is not None:
            self._send(ident, reply)

    def _handle(self, ident: bytes, msg: object):
        if isinstance(msg, StepEnd | StepBegin):
            session = self.sessions.get(ident)
            if session is None:
                return self._refuse("no_session", "send Hello before step messages")
            self._last_step = time.monotonic()
            return session.step_begin(msg) if isinstance(msg, StepBegin) else session.step_end(msg)
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
        old = self.sessions.pop(ident, None)
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
        )

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
        assert self._sock is not None
        try:
            self._sock.send_multipart([ident, self.codec.encode(msg)], zmq.NOBLOCK, copy=True)
        except zmq.Again:
            log.warning("dropped a reply: peer is not reading")


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
