"""The shim's ZeroMQ link to its sidecar: handshake, blocking calls, async sends.

StepEnd is sent without waiting; its StepResult is collected later (stashed
when it arrives while waiting for something else). The sidecar answers one
connection in order, so results arrive in step order.
"""

from __future__ import annotations

import time

import zmq

from proto.codec import Codec
from proto.messages import ErrorReply, Hello, Message, Reject, StepResult, Welcome


class SidecarError(RuntimeError):
    pass


class SidecarChannel:
    def __init__(self, endpoint: str, step_timeout_s: float) -> None:
        self.endpoint = endpoint
        self.step_timeout_ms = int(step_timeout_s * 1000)
        self.codec = Codec()
        self._sock = zmq.Context.instance().socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        # A blocking recv with a timeout costs one wake-up; poll() + recv() costs two.
        self._sock.setsockopt(zmq.RCVTIMEO, self.step_timeout_ms)
        self._sock.connect(endpoint)
        self._results: list[StepResult] = []
        self.acked_step = -1  # highest step whose StepResult arrived

    def handshake(self, hello: Hello, timeout_s: float) -> Welcome:
        self._sock.send(self.codec.encode(hello))
        deadline = time.monotonic() + timeout_s
        if not self._sock.poll(int(timeout_s * 1000)):
            raise SidecarError(
                f"no omni-sidecar answered at {self.endpoint} within {timeout_s:.0f}s. Start one "
                f"with `omni-sidecar serve --endpoint {self.endpoint} --hooks <set>` or point "
                "OMNI_SIDECAR_ENDPOINT at a running one (OMNI_SIDECAR_CONNECT_TIMEOUT sets the wait)."
            )
        reply = self._recv(max(0.0, deadline - time.monotonic()))
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
        """Results received so far; blocks until `until_step`'s result if given."""
        while True:
            try:
                while True:
                    frame = self._sock.recv(zmq.NOBLOCK)
                    self._stash(self.codec.decode(frame))
            except zmq.Again:
                pass
            if until_step is None or self.acked_step >= until_step:
                break
            self._stash(self._recv(self.step_timeout_ms / 1000))
        out, self._results = self._results, []
        return out

    def _stash(self, msg: Message) -> None:
        if isinstance(msg, StepResult):
            self._results.append(msg)
            self.acked_step = max(self.acked_step, msg.step)
        elif isinstance(msg, ErrorReply):
            raise SidecarError(f"sidecar rejected a step message: {msg.code}: {msg.message}")

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
                f"omni-sidecar at {self.endpoint} did not answer within {timeout_s:.0f}s "
                "(OMNI_SIDECAR_STEP_TIMEOUT)"
            ) from None
        return self.codec.decode(frame)

    def close(self) -> None:
        self._sock.close(0)
