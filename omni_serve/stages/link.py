"""The front end's async link to a stage's sidecar: per-step outputs followed, appends sent.

Speaks `proto` directly, so the front end needs no `omni_sidecar` import: outputs queries (what
every stream asks every few steps) many in flight at once on one DEALER socket (`OutputsChannel`),
the rest (appends, status, pings) one at a time on another. Every reply is decoded against the
protocol's schema; a reply of the wrong kind or none within the timeout is a `SidecarLost`.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np
import zmq
import zmq.asyncio
from vllm.logger import init_logger

from proto.codec import Codec, FrameError
from proto.messages import (AppendPayload, AppendReply, ErrorReply, Message, OutputsQuery, OutputsReply, Ping,
                            Pong, StatusQuery, StatusReply, TensorBlob)

# numpy has no bfloat16: such an output arrives widened to float32 by the reader below.
NUMPY_DTYPES = {"float32": np.float32, "float16": np.float16, "float64": np.float64, "int64": np.int64,
                "int32": np.int32, "int16": np.int16, "int8": np.int8, "uint8": np.uint8, "bool": np.bool_}


logger = init_logger(f"vllm.{__name__}")  # under vLLM's logger: its handler, format and VLLM_LOGGING_LEVEL
RESEND_AFTER_S = 1.0  # a live sidecar answers a query in milliseconds


class SidecarLost(ConnectionError):
    """The stage's sidecar did not answer (killed, restarting, or unreachable)."""


class RequestRejected(ValueError):
    """The sidecar refused an append or reported a hook error for the request."""


@dataclass
class Followed:
    """What one look at a request's per-step outputs brought."""

    chunks: list[dict[str, Any]] = field(default_factory=list)
    found: bool = False
    finished: bool = False


def blob_array(blob: TensorBlob) -> np.ndarray:
    """An output tensor as numpy; one whose bytes do not fit its shape and dtype is refused."""
    try:
        if blob.dtype == "bfloat16":  # the top half of a float32
            raw = np.frombuffer(blob.data, dtype=np.uint16).astype(np.uint32) << 16
            return raw.view(np.float32).reshape(blob.shape)
        if blob.dtype not in NUMPY_DTYPES:
            raise RequestRejected(f"an output of dtype {blob.dtype} the front end cannot read")
        return np.frombuffer(blob.data, dtype=NUMPY_DTYPES[blob.dtype]).reshape(blob.shape)
    except ValueError as exc:
        raise RequestRejected(f"a malformed output tensor ({blob.dtype}, shape {list(blob.shape)}): {exc}") from None


def answers(query: Message, reply: Message) -> bool:
    """Is `reply` the answer to `query` (as far as the reply says: the request or nonce it names)?"""
    if isinstance(reply, (OutputsReply, AppendReply)):
        return reply.req_id == query.req_id  # type: ignore[union-attr]
    if isinstance(reply, Pong):
        return isinstance(query, Ping) and reply.nonce == query.nonce
    return True


class ChannelClosed(Exception):
    """The channel a query waited on was closed under it (another query found it dead): ask again."""


class OutputsChannel:
    """Outputs queries in flight together on one connection. A stage's every stream asks for its
    outputs every few steps; one query at a time would queue each behind all the others' round trips
    (tens of milliseconds at 64 streams, each waiting for the front end's busy event loop to read its
    reply before the next goes out). The sidecar answers a connection's queries in the order they
    came, so a reply goes to the oldest query still waiting on the request it names; a query
    cancelled meanwhile keeps its place, and its reply is dropped."""

    def __init__(self, endpoint: str, codec: Codec) -> None:
        self.endpoint, self.codec = endpoint, codec
        self.sock = zmq.asyncio.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        self.waiting: dict[str, deque[asyncio.Future]] = {}
        self.closed = False
        self.reader = asyncio.get_running_loop().create_task(self._read())

    async def ask(self, query: OutputsQuery) -> asyncio.Future:
        """Sends the query; the future its reply resolves."""
        if self.closed:
            raise ChannelClosed()
        reply: asyncio.Future = asyncio.get_running_loop().create_future()
        self.waiting.setdefault(query.req_id, deque()).append(reply)
        try:
            await self.sock.send(self.codec.encode(query))
        except zmq.ZMQError as exc:
            self.close(SidecarLost(f"the sidecar at {self.endpoint}: {exc}"))
        return reply

    async def _read(self) -> None:
        while True:
            try:
                reply = self.codec.decode(await self.sock.recv())
            except FrameError as exc:
                return self.close(SidecarLost(f"the sidecar at {self.endpoint} sent a bad reply: {exc}"))
            except zmq.ZMQError as exc:
                return self.close(SidecarLost(f"the sidecar at {self.endpoint}: {exc}"))
            if not isinstance(reply, OutputsReply):
                return self.close(SidecarLost(f"the sidecar at {self.endpoint} answered {type(reply).__name__} "
                                              "to OutputsQuery"))
            queue = self.waiting.get(reply.req_id)
            if not queue:
                logger.warning("the sidecar at %s answered a query never asked (request %s)", self.endpoint,
                               reply.req_id)
                continue
            waiter = queue.popleft()
            if not queue:
                del self.waiting[reply.req_id]
            if not waiter.done():
                waiter.set_result(reply)

    def close(self, why: Exception | None = None) -> None:
        """Every query still waiting ends with `why` (ChannelClosed: it asks again elsewhere)."""
        if self.closed:
            return
        self.closed = True
        for queue in self.waiting.values():
            for waiter in queue:
                if not waiter.done():
                    waiter.set_exception(why or ChannelClosed())
        self.waiting.clear()
        if self.reader is not asyncio.current_task() and not self.reader.done():
            with contextlib.suppress(RuntimeError):  # its loop already closed
                self.reader.cancel()
        self.sock.close(0)


class AsyncSidecarClient:
    def __init__(self, endpoint: str, timeout_s: float = 5.0) -> None:
        self.endpoint = endpoint
        self.timeout_s = timeout_s
        self.codec = Codec()
        self._lock = asyncio.Lock()
        self._sock: zmq.asyncio.Socket | None = None
        self._channel: OutputsChannel | None = None

    async def _ask(self, query: OutputsQuery) -> OutputsReply:
        """An outputs query, answered within the timeout; unanswered after RESEND_AFTER_S it goes
        again on a fresh connection (it only reads or drops), which reaches whoever serves the
        endpoint now (a successor after a hot upgrade took over the path)."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            if self._channel is None or self._channel.closed:
                self._channel = OutputsChannel(self.endpoint, self.codec)
            channel = self._channel
            try:
                reply = await channel.ask(query)
                return await asyncio.wait_for(reply, max(0.001, min(deadline - time.monotonic(), RESEND_AFTER_S)))
            except (asyncio.TimeoutError, ChannelClosed):
                channel.close()  # the queries still waiting on it ask again on the next
            if time.monotonic() >= deadline:
                raise SidecarLost(f"the sidecar at {self.endpoint} did not answer within {self.timeout_s:.0f}s")

    def _socket(self) -> zmq.asyncio.Socket:
        if self._sock is None:
            sock = zmq.asyncio.Context.instance().socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(self.endpoint)
            self._sock = sock
        return self._sock

    def _drop(self) -> None:
        """A reply that never came may still come: a fresh socket, so it is never read as the next one's."""
        if self._sock is not None:
            self._sock.close(0)
            self._sock = None

    async def _call(self, msg: Message, want: type | tuple[type, ...], again: bool = True) -> Message:
        """One query, answered within the timeout. `again`: the query may be sent twice (it only reads or
        drops): unanswered after a slice of the timeout, it goes again on a fresh connection, which
        reaches whoever serves the endpoint now (a successor after a hot upgrade took over the path)."""
        deadline = time.monotonic() + self.timeout_s
        async with self._lock:
            while True:
                sock = self._socket()
                left = deadline - time.monotonic()
                wait = min(left, RESEND_AFTER_S) if again else left
                try:
                    await sock.send(self.codec.encode(msg))
                    if await sock.poll(max(1, int(wait * 1000))):
                        reply = self.codec.decode(await sock.recv())
                        if answers(msg, reply):
                            break
                        # Another query's: never taken for this one's (a fresh socket, asked again if it may be).
                        logger.warning("the sidecar at %s answered another query (%s to %s)", self.endpoint,
                                       type(reply).__name__, type(msg).__name__)
                        if not again:
                            self._drop()
                            raise SidecarLost(f"the sidecar at {self.endpoint} answered another query")
                except FrameError as exc:
                    self._drop()
                    raise SidecarLost(f"the sidecar at {self.endpoint} sent a bad reply: {exc}") from None
                except zmq.ZMQError as exc:
                    self._drop()
                    raise SidecarLost(f"the sidecar at {self.endpoint}: {exc}") from None
                except BaseException:
                    # Cancelled (a request's task stopped) between the query and its reply: the reply
                    # still comes, and the next query on this socket would read it as its own.
                    self._drop()
                    raise
                self._drop()
                if time.monotonic() >= deadline:
                    raise SidecarLost(f"the sidecar at {self.endpoint} did not answer within {self.timeout_s:.0f}s")
        if not isinstance(reply, want):
            raise SidecarLost(f"the sidecar at {self.endpoint} answered {type(reply).__name__} to "
                              f"{type(msg).__name__}")
        return reply

    async def ping(self) -> bool:
        try:
            return isinstance(await self._call(Ping(1), Pong), Pong)
        except SidecarLost:
            return False

    async def status(self) -> StatusReply:
        return await self._call(StatusQuery(), StatusReply)  # type: ignore[return-value]

    async def follow(self, req_id: str, cursor: int) -> tuple[Followed, int]:
        """The request's per-step outputs from `cursor` on, and the cursor to ask with next."""
        reply = await self._ask(OutputsQuery(req_id, since=cursor))
        if reply.error:
            raise RequestRejected(reply.error)
        chunks = [{**c.values, **{k: blob_array(b) for k, b in c.tensors.items()}} for c in reply.chunks]
        return Followed(chunks, reply.found, reply.found and reply.finished), reply.cursor

    async def outputs(self, req_id: str) -> tuple[dict[str, Any], Followed]:
        """The request's assembled outputs so far (they survive a hot upgrade whole, where a cursor
        into the per-step chunks may not)."""
        reply = await self._ask(OutputsQuery(req_id))
        if reply.error:
            raise RequestRejected(reply.error)
        values = {**reply.values, **{k: blob_array(b) for k, b in reply.tensors.items()}}
        return values, Followed([], reply.found, reply.found and reply.finished)

    async def forget(self, req_id: str) -> None:
        """Drop a request's kept outputs (the front end has read them)."""
        await self._ask(OutputsQuery(req_id, pop=True))

    async def append(self, req_id: str, entries: dict[str, Any]) -> int:
        """Entries (vllm-omni's additional_information) into a running request; the last step not seeing them."""
        reply = await self._call(AppendPayload(req_id, msgspec.msgpack.encode(entries)), (AppendReply, ErrorReply),
                                 again=False)
        if isinstance(reply, ErrorReply):
            raise RequestRejected(f"{reply.code}: {reply.message}")
        return reply.after_step  # type: ignore[union-attr]

    def close(self) -> None:
        self._drop()
        if self._channel is not None:
            self._channel.close()
            self._channel = None
