"""Control client: status, outputs, ping, drain. What `omni-sidecar status` and apps use."""

from __future__ import annotations

import torch
import zmq

from omni_sidecar.tensors import tensor_from_bytes
from proto.codec import Codec
from proto.endpoint import default_endpoint
from proto.messages import (
    Drain,
    Drained,
    ErrorReply,
    Message,
    OutputsQuery,
    OutputsReply,
    Ping,
    Pong,
    StatusQuery,
    StatusReply,
)


class SidecarUnavailable(ConnectionError):
    pass


class SidecarClient:
    def __init__(self, endpoint: str | None = None, timeout_s: float = 5.0) -> None:
        self.endpoint = endpoint or default_endpoint()
        self.timeout_ms = int(timeout_s * 1000)
        self.codec = Codec()
        self._sock = zmq.Context.instance().socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(self.endpoint)

    def close(self) -> None:
        self._sock.close(0)

    def __enter__(self) -> "SidecarClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, msg: Message, want: type) -> Message:
        self._sock.send(self.codec.encode(msg))
        if not self._sock.poll(self.timeout_ms):
            raise SidecarUnavailable(
                f"no answer from the sidecar at {self.endpoint} within "
                f"{self.timeout_ms / 1000:.1f}s; is `omni-sidecar serve` running there?"
            )
        reply = self.codec.decode(self._sock.recv())
        if isinstance(reply, ErrorReply):
            raise RuntimeError(f"sidecar refused {type(msg).__name__}: {reply.code}: {reply.message}")
        if not isinstance(reply, want):
            raise RuntimeError(f"expected {want.__name__}, got {type(reply).__name__}")
        return reply

    def ping(self, nonce: int = 0) -> int:
        return self._call(Ping(nonce), Pong).nonce  # type: ignore[union-attr]

    def status(self) -> StatusReply:
        return self._call(StatusQuery(), StatusReply)  # type: ignore[return-value]

    def outputs(self, req_id: str, pop: bool = False) -> dict[str, torch.Tensor] | None:
        """The outputs the hook set assembled for a vLLM request id (None if unknown)."""
        reply: OutputsReply = self._call(OutputsQuery(req_id, pop), OutputsReply)  # type: ignore[assignment]
        if not reply.found:
            return None
        return {
            name: tensor_from_bytes(b.data, b.shape, b.dtype) for name, b in reply.tensors.items()
        }

    def drain(self) -> int:
        return self._call(Drain(), Drained).sessions_left  # type: ignore[union-attr]
