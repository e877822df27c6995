"""Control client: status, outputs, appends, ping, drain. What `omni-sidecar status` and apps use."""

from __future__ import annotations

import os
import time
from typing import Any, Iterator, NamedTuple

import zmq

from omni_sidecar.errors import OmniSidecarError
from proto.codec import Codec, FrameError
from proto.endpoint import default_endpoint, ipc_path
from proto.messages import (
    AppendPayload,
    AppendReply,
    Drain,
    ErrorReply,
    Drained,
    Message,
    OutputsQuery,
    OutputsReply,
    Ping,
    Pong,
    StatusQuery,
    StatusReply,
)
from proto.transport import apply_curve_client, reply_problem


class SidecarUnavailable(OmniSidecarError, ConnectionError):
    pass


class RequestFailed(OmniSidecarError, RuntimeError):
    """The sidecar's hooks failed this request; the message says why."""

    def __init__(self, req_id: str, message: str) -> None:
        super().__init__(f"request {req_id}: {message}")
        self.req_id = req_id
        self.message = message


class AppendRefused(OmniSidecarError, ValueError):
    """The sidecar did not append to the request (unknown, finished, or its hooks refused the entries);
    `code` is the ErrorReply's code. Nothing else changed: the request runs on with its state as it was."""

    def __init__(self, req_id: str, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.req_id = req_id
        self.code = code


PROBE_TIMEOUT_S = 0.3


def answers(endpoint: str, timeout_s: float = PROBE_TIMEOUT_S) -> bool:
    """Does a sidecar answer a ping at `endpoint` now? (No socket file: no, at once.)"""
    try:
        with SidecarClient(endpoint, timeout_s=timeout_s) as client:
            client.ping()
        return True
    except SidecarUnavailable:
        return False


def wait_ready(endpoint: str, timeout_s: float = 60.0, proc: Any = None) -> None:
    """Block until a sidecar answers a ping at `endpoint` (and `proc`, if given, is alive)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise SidecarUnavailable(f"the sidecar process exited with {proc.returncode} before it was ready")
        if answers(endpoint):
            return
        time.sleep(0.01)
    raise SidecarUnavailable(f"no sidecar answered at {endpoint} within {timeout_s:.0f}s")


def _decode(tensors: dict, values: dict) -> dict[str, Any]:
    # Here, not at the top: `omni-sidecar status` and `upgrade` must start without importing torch.
    from omni_arena.views import tensor_from_bytes

    out: dict[str, Any] = dict(values)
    for name, b in tensors.items():
        out[name] = tensor_from_bytes(b.data, b.shape, b.dtype)
    return out


def _append_bytes(payload: bytes | dict[str, Any]) -> bytes:
    if isinstance(payload, bytes):
        return payload
    import msgspec

    from omni_sidecar.hook_sets.omni.wire import encode_additional_information

    return msgspec.msgpack.encode(encode_additional_information(payload))


class StreamPoll(NamedTuple):
    chunks: list[dict[str, Any]]  # per-step outputs past the cursor asked with, in step order
    cursor: int  # ask with this next time
    found: bool  # the sidecar knows the request (not yet admitted: False)
    finished: bool  # no more chunks will come


class SidecarClient:
    """Raises SidecarUnavailable at once for an endpoint that cannot work (malformed, or an
    ipc:// socket file that does not exist), instead of waiting out the timeout."""

    def __init__(self, endpoint: str | None = None, timeout_s: float = 5.0,
                 curve_keys: str | None = None) -> None:
        self.endpoint = endpoint or default_endpoint()
        self.timeout_ms = int(timeout_s * 1000)
        self.codec = Codec()
        path = ipc_path(self.endpoint)
        if path is None and not self.endpoint.startswith("tcp://"):
            raise SidecarUnavailable(
                f"endpoint {self.endpoint!r}: use ipc:///path/to/socket (or tcp://host:port with CURVE keys)"
            )
        if path is not None and not os.path.exists(path):
            raise SidecarUnavailable(
                f"no sidecar at {self.endpoint}: the socket file does not exist "
                "(start one with `omni-sidecar serve --endpoint ...`)"
            )
        self._sock = zmq.Context.instance().socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        try:
            if curve_keys:
                apply_curve_client(self._sock, curve_keys)
            self._sock.connect(self.endpoint)
        except (zmq.ZMQError, OSError) as exc:
            self._sock.close(0)
            raise SidecarUnavailable(f"cannot connect to {self.endpoint}: {exc}") from None

    def close(self) -> None:
        self._sock.close(0)

    def __enter__(self) -> "SidecarClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, msg: Message, want: type | tuple[type, ...]) -> Message:
        self._sock.send(self.codec.encode(msg))
        if not self._sock.poll(self.timeout_ms):
            raise SidecarUnavailable(
                f"no answer from the sidecar at {self.endpoint} within "
                f"{self.timeout_ms / 1000:.1f}s; is `omni-sidecar serve` running there?"
            )
        try:
            reply = self.codec.decode(self._sock.recv())
        except FrameError as exc:
            raise SidecarUnavailable(f"the sidecar at {self.endpoint} sent a bad reply: {exc}") from None
        first = want[0] if isinstance(want, tuple) else want
        problem = "" if isinstance(reply, want) else reply_problem(msg, reply, first)
        if problem:
            raise SidecarUnavailable(problem)
        return reply

    def ping(self, nonce: int = 0) -> int:
        return self._call(Ping(nonce), Pong).nonce  # type: ignore[union-attr]

    def status(self) -> StatusReply:
        return self._call(StatusQuery(), StatusReply)  # type: ignore[return-value]

    def outputs(self, req_id: str, pop: bool = False) -> dict[str, Any] | None:
        """The outputs the hook set assembled for a request (None if unknown).

        `req_id` is the id you gave vLLM or vLLM's internal one. Raises
        RequestFailed if the hooks reported an error for it.
        """
        reply: OutputsReply = self._call(OutputsQuery(req_id, pop), OutputsReply)  # type: ignore[assignment]
        if not reply.found:
            return None
        if reply.error:
            raise RequestFailed(req_id, reply.error)
        return _decode(reply.tensors, reply.values)

    def append(self, req_id: str, payload: bytes | dict[str, Any]) -> int:
        """Append entries to the running request `req_id` (your id or vLLM's): vllm-omni's
        additional_information as msgpack bytes, or a nested dict (`{"embed": {"decode": t,
        "decode_token_start": 0}}`) encoded here. Applied between two steps; returns the last step
        that did not see it. Raises AppendRefused (unknown or finished request, refused entries)."""
        reply = self._call(AppendPayload(req_id, _append_bytes(payload)), (AppendReply, ErrorReply))
        if isinstance(reply, ErrorReply):
            raise AppendRefused(req_id, reply.code, reply.message)
        return reply.after_step  # type: ignore[union-attr]

    def poll(self, req_id: str, cursor: int = 0) -> StreamPoll:
        """One look at a request's per-step outputs past `cursor` (no waiting): for a client that
        follows several requests at once. Raises RequestFailed if the hooks reported an error."""
        reply: OutputsReply = self._call(OutputsQuery(req_id, since=cursor), OutputsReply)  # type: ignore[assignment]
        if reply.error:
            raise RequestFailed(req_id, reply.error)
        return StreamPoll([_decode(c.tensors, c.values) for c in reply.chunks], reply.cursor,
                          reply.found, reply.found and reply.finished)

    def stream(
        self, req_id: str, poll_s: float = 0.02, timeout_s: float = 600.0
    ) -> Iterator[dict[str, Any]]:
        """Yield the request's per-step outputs as they are produced, until it finishes
        (a request not known yet is waited for)."""
        cursor, deadline, seen = 0, time.monotonic() + timeout_s, False
        while time.monotonic() < deadline:
            got = self.poll(req_id, cursor)
            seen = seen or got.found
            yield from got.chunks
            cursor = got.cursor
            if seen and (got.finished or not got.found):
                return
            time.sleep(poll_s)
        raise TimeoutError(f"request {req_id} did not finish within {timeout_s}s")

    def drain(self) -> int:
        return self._call(Drain(), Drained).sessions_left  # type: ignore[union-attr]


class AppendStream:
    """Appends sent without waiting for their answers, for a driver that steps its engine itself.

    An append to a model that reads its state in the vLLM process (its own hooks: the shim's
    mirror) is answered only once a step has applied it, so a driver that waits for the answer
    before stepping waits for ever. Here `send` returns at once; the worker tells when the
    append is in (`llm.collective_rpc("omni_sidecar_mirror_waiting")`); `answers` collects
    the sidecar's answers in sending order. Use this client for appends only."""

    def __init__(self, endpoint: str | None = None, timeout_s: float = 5.0) -> None:
        self._client = SidecarClient(endpoint, timeout_s)
        self.in_flight: list[str] = []  # request ids of the appends not answered yet, in order

    def send(self, req_id: str, payload: bytes | dict[str, Any]) -> None:
        self._client._sock.send(self._client.codec.encode(AppendPayload(req_id, _append_bytes(payload))))
        self.in_flight.append(req_id)

    def answers(self, wait_s: float = 0.0) -> list[tuple[str, int]]:
        """(request id, the last step that did not see it) of the appends answered so far (waiting up
        to `wait_s` for each missing one); raises AppendRefused for one that was refused."""
        done: list[tuple[str, int]] = []
        sock = self._client._sock
        while self.in_flight and sock.poll(int(wait_s * 1000)):
            try:
                reply = self._client.codec.decode(sock.recv())
            except FrameError as exc:
                raise SidecarUnavailable(f"the sidecar at {self._client.endpoint} sent a bad reply: {exc}") from None
            req_id = self.in_flight.pop(0)
            if isinstance(reply, ErrorReply):
                raise AppendRefused(req_id, reply.code, reply.message)
            if not isinstance(reply, AppendReply):
                raise SidecarUnavailable(f"the sidecar answered an append with {type(reply).__name__}")
            done.append((req_id, reply.after_step))
        return done

    def close(self) -> None:
        self._client.close()

    def __enter__(self) -> "AppendStream":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
