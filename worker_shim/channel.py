"""The shim's ZeroMQ link to its sidecar: handshake, blocking calls, async sends.

StepEnd is sent without waiting; its StepResult is collected later (stashed
when it arrives while waiting for something else). The sidecar answers one
connection in order, so results arrive in step order. Every frame from the
sidecar is untrusted: anything malformed becomes a SidecarError, never a crash.
A socket monitor tells the shim at once when the sidecar's end goes away.
"""

from __future__ import annotations

import zmq
from zmq.utils.monitor import recv_monitor_message

from proto.codec import Codec, FrameError
from proto.messages import ErrorReply, Hello, Message, Reject, StepResult, Welcome


HEARTBEAT_IVL_MS = 1000
HEARTBEAT_TIMEOUT_MS = 3000


class SidecarError(RuntimeError):
    pass


def _apply_curve_client(sock: zmq.Socket, keys_dir: str) -> None:
    """tcp:// only: our `client.key_secret` and the sidecar's public `server.key`."""
    import os

    import zmq.auth

    pub, sec = zmq.auth.load_certificate(os.path.join(keys_dir, "client.key_secret"))
    server_pub, _ = zmq.auth.load_certificate(os.path.join(keys_dir, "server.key"))
    sock.curve_secretkey, sock.curve_publickey, sock.curve_serverkey = sec, pub, server_pub


class SidecarChannel:
    def __init__(self, endpoint: str, step_timeout_s: float, curve_keys: str | None = None) -> None:
        self.endpoint = endpoint
        self.step_timeout_ms = int(step_timeout_s * 1000)
        self.codec = Codec()
        self._sock = zmq.Context.instance().socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        # A blocking recv with a timeout costs one wake-up; poll() + recv() costs two.
        self._sock.setsockopt(zmq.RCVTIMEO, self.step_timeout_ms)
        # ZMTP heartbeats from libzmq's I/O thread: a sidecar that stops answering (SIGSTOP,
        # a hung host) is disconnected within HEARTBEAT_TIMEOUT even while vLLM is idle.
        self._sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
        self._sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
        self._monitor = self._sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        if curve_keys:
            _apply_curve_client(self._sock, curve_keys)
        self._sock.connect(endpoint)
        self._results: list[StepResult] = []
        self._welcome: Welcome | None = None
        self.acked_step = -1  # highest step whose StepResult arrived

    # -- handshake ---------------------------------------------------------------

    def handshake(self, hello: Hello, timeout_s: float) -> Welcome:
        """Blocking handshake (start-up): fail fast with what to do next."""
        self.send(hello)
        if not self._sock.poll(int(timeout_s * 1000)):
            raise SidecarError(
                f"no omni-sidecar answered at {self.endpoint} within {timeout_s:.0f}s. Start one "
                f"with `omni-sidecar serve --endpoint {self.endpoint} --hooks <set>` or point "
                "OMNI_SIDECAR_ENDPOINT at a running one (OMNI_SIDECAR_CONNECT_TIMEOUT sets the wait)."
            )
        return self._check_welcome(hello, self._recv(self.step_timeout_ms / 1000))

    def poll_welcome(self, hello: Hello, wait_ms: int = 0) -> Welcome | None:
        """Handshake without blocking a step for long (reconnect): the Welcome if it arrived."""
        if wait_ms and not self._sock.poll(wait_ms):
            return None
        try:
            frame = self._sock.recv(zmq.NOBLOCK)
        except zmq.Again:
            return None
        return self._check_welcome(hello, self._decode(frame))

    def _check_welcome(self, hello: Hello, reply: Message) -> Welcome:
        if isinstance(reply, Reject):
            raise SidecarError(f"omni-sidecar at {self.endpoint} refused this shim: {reply.reason}")
        if not isinstance(reply, Welcome):
            raise SidecarError(f"omni-sidecar answered Hello with {type(reply).__name__}")
        if reply.protocol_major != hello.protocol_major:
            raise SidecarError(
                f"omni-sidecar at {self.endpoint} speaks protocol {reply.protocol_major}."
                f"{reply.protocol_minor}, this shim speaks {hello.protocol_major}."
                f"{hello.protocol_minor}; install matching omni-sidecar versions on both sides"
            )
        return reply

    # -- traffic -----------------------------------------------------------------

    def send(self, msg: Message) -> None:
        self._sock.send(self.codec.encode(msg), copy=True)

    def call(self, msg: Message, want: type) -> Message:
        self.send(msg)
        while True:
            reply = self._recv(self.step_timeout_ms / 1000)
            if isinstance(reply, StepResult):
                self._stash(reply)
                continue
            if isinstance(reply, ErrorReply):
                raise SidecarError(f"sidecar rejected {type(msg).__name__}: {reply.code}: {reply.message}")
            if not isinstance(reply, want):
                raise SidecarError(f"expected {want.__name__}, sidecar sent {type(reply).__name__}")
            return reply

    def take_results(self, until_step: int | None = None) -> list[StepResult]:
        """Results received so far; blocks (up to the step timeout) for `until_step`'s."""
        while True:
            try:
                while True:
                    self._stash(self._decode(self._sock.recv(zmq.NOBLOCK)))
            except zmq.Again:
                pass
            if until_step is None or self.acked_step >= until_step:
                break
            self._stash(self._recv(self.step_timeout_ms / 1000))
        out, self._results = self._results, []
        return out

    def peer_gone(self) -> bool:
        """True once the sidecar's end of the connection went away (crash, kill, stop)."""
        gone = False
        # Called every step: poll(0) is a cheap "nothing new" (no exception on the common path).
        while self._monitor.poll(0):
            if recv_monitor_message(self._monitor)["event"] == zmq.EVENT_DISCONNECTED:
                gone = True
        return gone

    def _stash(self, msg: Message) -> None:
        if isinstance(msg, StepResult):
            self._results.append(msg)
            self.acked_step = max(self.acked_step, msg.step)
        elif isinstance(msg, ErrorReply):
            raise SidecarError(f"sidecar rejected a step message: {msg.code}: {msg.message}")
        else:
            raise SidecarError(f"unexpected {type(msg).__name__} from the sidecar")

    def _decode(self, frame: bytes) -> Message:
        try:
            return self.codec.decode(frame)
        except FrameError as exc:
            raise SidecarError(f"bad frame from the sidecar: {exc}") from None

    def _recv(self, timeout_s: float) -> Message:
        try:
            if timeout_s * 1000 >= self.step_timeout_ms:
                frame = self._sock.recv()
            elif self._sock.poll(int(timeout_s * 1000)):
                frame = self._sock.recv()
            else:
                raise zmq.Again()
        except zmq.Again:
            raise SidecarError(
                f"omni-sidecar at {self.endpoint} did not answer within {timeout_s:.1f}s "
                "(OMNI_SIDECAR_STEP_TIMEOUT)"
            ) from None
        return self._decode(frame)

    def close(self) -> None:
        try:
            self._sock.disable_monitor()
        except zmq.ZMQError:
            pass
        self._monitor.close(0)
        self._sock.close(0)
