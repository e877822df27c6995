"""The sidecar's ZeroMQ ROUTER socket: bound securely, frames in, frames out, removed on close.

Who may connect is decided here (omni_sidecar/serve/security.py): an owner-only Unix
socket with a uid filter, or CURVE on tcp://. Sends never block: a peer that does
not read loses that reply (it times out and reconnects), never the whole loop.
"""

from __future__ import annotations

import logging
import os
import threading
import time

import zmq
from zmq.utils.monitor import recv_monitor_message

from omni_sidecar.serve.security import CurveServer, filter_peers, prepare_socket_dir, secure_socket_file
from proto.endpoint import ipc_path
from proto.transport import set_heartbeats
from omni_sidecar.serve.rejects import REJECT_LOG_INTERVAL_S as DROP_LOG_INTERVAL_S

log = logging.getLogger("omni_sidecar.listener")
RECV_TIMEOUT_MS = 200  # a blocking recv wakes this often, so signals act promptly
CLOSE_LINGER_MS = 1000  # last replies (a SwitchAck, the successor's state) may still leave


class Listener:
    def __init__(self, max_frame_bytes: int, allowed_uids: list[int], curve_keys: str | None) -> None:
        self.max_frame_bytes = max_frame_bytes
        self.allowed_uids = allowed_uids
        self.curve_keys = curve_keys
        # Our own context: only terminating it makes ZeroMQ send what is still queued (the
        # successor's state, last SwitchAcks) before the process exits; see flush().
        self.ctx = zmq.Context()
        self._curve: CurveServer | None = None
        self._bound: list[tuple[str, int]] = []  # (socket path, inode) this process bound
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.dropped_replies = 0
        self._next_drop_log = 0.0
        self.last_fd = -1
        # ZeroMQ tells a ROUTER nothing per peer, but its monitor reports each closed connection
        # by file descriptor; with ZMTP heartbeats a vanished or frozen peer's connection closes
        # within HEARTBEAT_TIMEOUT_MS, whatever process or PID namespace it lives in.
        self._monitor = self.sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)

    def bind(self, endpoint: str) -> None:
        """Configure the socket for `endpoint`'s kind of security and bind it."""
        sock = self.sock
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
        # Frames over the cap get a clear error from the codec; libzmq drops the connection
        # only for frames past twice the cap, before they are ever buffered whole.
        sock.setsockopt(zmq.MAXMSGSIZE, 2 * self.max_frame_bytes)
        set_heartbeats(sock)
        path = ipc_path(endpoint)
        if path is not None:
            prepare_socket_dir(path)
            if os.path.exists(path):
                os.unlink(path)  # a stale socket left by a dead sidecar (the caller checked)
            filter_peers(sock, self.allowed_uids)
        else:
            self._curve = CurveServer(self.ctx, self.curve_keys or "")
            self._curve.apply(sock)
        self.bind_also(endpoint)
        sock.setsockopt(zmq.RCVTIMEO, RECV_TIMEOUT_MS)

    def bind_also(self, endpoint: str) -> None:
        """Bind one more address (owner-only); its socket file is removed on close if still ours."""
        old_umask = os.umask(0o077)
        try:
            self.sock.bind(endpoint)
        finally:
            os.umask(old_umask)
        path = ipc_path(endpoint)
        if path is not None:
            secure_socket_file(path)
            self._bound.append((path, os.stat(path).st_ino))

    def replace_path(self, endpoint: str) -> None:
        """Take over `endpoint`'s socket file from a predecessor (its own socket stays open)."""
        path = ipc_path(endpoint)
        if path is None:
            return
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        self.bind_also(endpoint)

    @staticmethod
    def give_path(successor: str, usual: str) -> None:
        """Move the successor's socket file onto `usual` (rename is atomic): from now on a shim that
        connects there reaches the successor, never this draining sidecar, even before the
        successor binds `usual` itself."""
        src, dst = ipc_path(successor), ipc_path(usual)
        if src is not None and dst is not None and os.path.exists(src):
            os.replace(src, dst)

    # -- traffic ---------------------------------------------------------------

    def recv_frames(self) -> list[bytes]:
        """[identity, body, extra frames...]; frame by frame, which is cheaper than recv_multipart.

        zmq.Again when nothing arrived within RECV_TIMEOUT_MS."""
        sock = self.sock
        ident = sock.recv(copy=False)  # ROUTER: an identity, then at least one frame
        self.last_fd = ident.get(zmq.SRCFD)  # the connection it came on (see disconnected_fds)
        frames = [ident.bytes, sock.recv()]
        while sock.rcvmore:
            frames.append(sock.recv())
        return frames

    def readable(self) -> bool:
        return bool(self.sock.getsockopt(zmq.EVENTS) & zmq.POLLIN)

    def poll(self, timeout_ms: int) -> bool:
        return bool(self.sock.poll(timeout_ms))

    def send(self, ident: bytes, frame: bytes) -> bool:
        try:
            self.sock.send(ident, zmq.SNDMORE | zmq.NOBLOCK)
            self.sock.send(frame, zmq.NOBLOCK)
            return True
        except zmq.Again:
            self.dropped_replies += 1
            now = time.monotonic()
            if now >= self._next_drop_log:  # a peer that never reads must not flood the log
                self._next_drop_log = now + DROP_LOG_INTERVAL_S
                log.warning("dropped a reply: a peer is not reading (%d dropped so far)", self.dropped_replies)
            return False

    def disconnected_fds(self) -> list[int]:
        """File descriptors of connections that closed since the last call (never blocks)."""
        fds = []
        while self._monitor.poll(0):
            event = recv_monitor_message(self._monitor)
            if event["event"] == zmq.EVENT_DISCONNECTED:
                fds.append(int(event["value"]))
        return fds

    def close(self) -> None:
        try:
            self.sock.disable_monitor()
        except zmq.ZMQError:
            pass
        self._monitor.close(0)
        if self._curve is not None:
            self._curve.stop()
            self._curve = None
        # Unlink while still bound: a closed socket's inode number can go to the next file made,
        # e.g. the successor's socket at the same path, which an inode check would then take for ours.
        for path, ino in self._bound:
            try:
                if os.stat(path).st_ino == ino:
                    os.unlink(path)  # never a successor's socket that replaced ours
            except FileNotFoundError:
                pass
        self._bound.clear()
        self.sock.close(linger=CLOSE_LINGER_MS)

    def flush(self) -> None:
        """Send what is still queued (up to CLOSE_LINGER_MS), once every socket of ours is closed.

        A closed socket's linger applies only while its context terminates; a process that exits
        without terminating it drops queued frames, e.g. the state a successor waits for."""
        if self.ctx.closed:
            return
        done = threading.Thread(target=self.ctx.term, name="omni-zmq-flush", daemon=True)
        done.start()
        done.join(CLOSE_LINGER_MS / 1000 + 0.5)  # a socket left open would block term() for ever
        if done.is_alive():
            log.warning("some ZeroMQ socket was left open: queued replies may not have left")
