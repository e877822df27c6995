"""The shim's link to its sidecar: handshake, blocking calls, async sends.

StepEnd is sent without waiting; its StepResult is collected later (stashed
when it arrives while waiting for something else). The sidecar answers one
connection in order, so results arrive in step order. Every frame from the
sidecar is untrusted: anything malformed becomes a SidecarError, never a crash.
A socket monitor tells the shim at once when the sidecar's end goes away.

Fast path (issue #6, DESIGN §8): the Hello offers two shared-memory rings
(proto/shmring.py); once the Welcome accepts them, step messages travel through
them and the socket keeps the handshake, control messages (behind a ring MARK,
so one order holds per connection), heartbeats and kicks. Waiting for a reply
polls the ring with sched_yield for `spin_us`, then sleeps on the socket until
the sidecar's kick (or `sleep_ms`, then re-checks), watching the step timeout
and the socket monitor all along. OMNI_SIDECAR_RING=0, or a sidecar that does
not accept rings, keeps everything on ZeroMQ.
"""

from __future__ import annotations

import logging
import os
import platform
import time

import msgspec
import zmq
from zmq.utils.monitor import recv_monitor_message

from proto.arena import ArenaError
from proto.codec import Codec, FrameError
from proto.messages import ErrorReply, Hello, Message, Reject, StepBegin, StepEnd, StepResult, Welcome
from proto.shmring import EMPTY, RingDuplex, RingError, ShmRing
from worker_shim.config import RingConfig

log = logging.getLogger("vllm.omni_sidecar.shim.channel")
RING_MESSAGES = (StepBegin, StepEnd)  # what travels in the ring; everything else is control
FULL_RING_WAIT_S = 0.0002
TSO_MACHINES = ("x86_64", "amd64")  # where the rings' store order holds without fences

HEARTBEAT_IVL_MS = 1000
HEARTBEAT_TIMEOUT_MS = 3000


class SidecarError(RuntimeError):
    pass


def _apply_curve_client(sock: zmq.Socket, keys_dir: str) -> None:
    """tcp:// only: our `client.key_secret` and the sidecar's public `server.key`."""
    import zmq.auth

    pub, sec = zmq.auth.load_certificate(os.path.join(keys_dir, "client.key_secret"))
    server_pub, _ = zmq.auth.load_certificate(os.path.join(keys_dir, "server.key"))
    sock.curve_secretkey, sock.curve_publickey, sock.curve_serverkey = sec, pub, server_pub


class SidecarChannel:
    def __init__(self, endpoint: str, step_timeout_s: float, curve_keys: str | None = None,
                 ring: RingConfig | None = None) -> None:
        self.endpoint = endpoint
        self.ring_config = ring if ring is not None else RingConfig.from_env()
        self._offer: tuple[ShmRing, ShmRing] | None = None  # (to sidecar, from sidecar) until Welcome
        self.duplex: RingDuplex | None = None  # set once the sidecar accepted the rings
        self._gone = False
        self.kicks_sent = 0
        self.sleeps = 0
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
        offer, self._offer = self._offer, None
        if offer is not None:
            if reply.rings:
                self.duplex = RingDuplex(tx=offer[0], rx=offer[1])
                log.info("omni-sidecar session %d: step messages over shared-memory rings (%d KiB each way)",
                         reply.session, self.ring_config.capacity_kib)
            else:  # an older sidecar, or one started with rings off: ZeroMQ only
                for ring in offer:
                    ring.close()
        return reply

    def _offer_rings(self, hello: Hello) -> Hello:
        """Create this connection's two rings and name them in the Hello (fresh ones per Hello)."""
        if not self.ring_config.enabled or self.duplex is not None:
            return hello
        if platform.machine().lower() not in TSO_MACHINES:
            log.warning("no shared-memory rings on %s: their unfenced publication relies on x86-64 store "
                        "order (proto/shmring.py); step messages go over ZeroMQ", platform.machine())
            return hello
        self._close_offer()
        size = self.ring_config.capacity_kib << 10
        rings: list[ShmRing] = []
        try:
            for prefix in ("omni-ring-up", "omni-ring-down"):
                rings.append(ShmRing.create(size, prefix=prefix))  # + pid + random
        except (OSError, ArenaError) as exc:
            for ring in rings:
                ring.close()
            log.warning("no shared-memory rings (%s): step messages go over ZeroMQ", exc)
            return hello
        self._offer = (rings[0], rings[1])
        return msgspec.structs.replace(hello, rings=[r.info() for r in rings])

    def _close_offer(self) -> None:
        offer, self._offer = self._offer, None
        for ring in offer or ():
            ring.close()

    @property
    def ring_active(self) -> bool:
        return self.duplex is not None

    # -- traffic -----------------------------------------------------------------

    def send(self, msg: Message) -> None:
        if isinstance(msg, Hello):
            msg = self._offer_rings(msg)
        frame = self.codec.encode(msg)
        if self.duplex is None:
            self._sock.send(frame, copy=True)
        else:
            self._ring_send(frame, control=not isinstance(msg, RING_MESSAGES))

    def _ring_send(self, frame: bytes, control: bool) -> None:
        """Into the ring (kick the sidecar if it sleeps), or MARK + socket; waits while full."""
        duplex = self.duplex
        assert duplex is not None
        deadline = 0.0
        while True:
            try:
                outcome = duplex.send(frame, control)
            except RingError as exc:
                raise SidecarError(f"bad shared-memory ring: {exc}") from None
            if outcome == "ring":
                if duplex.peer_sleeping():
                    self._kick()
                return
            if outcome == "socket":
                self._sock.send(frame, copy=True)
                return
            # Full: the sidecar is behind on this connection. Wait, as long as a reply may take.
            now = time.monotonic()
            deadline = deadline or now + self.step_timeout_ms / 1000
            if now > deadline:
                raise SidecarError(
                    f"omni-sidecar at {self.endpoint} did not drain its ring within "
                    f"{self.step_timeout_ms / 1000:.1f}s (OMNI_SIDECAR_STEP_TIMEOUT)"
                )
            if self.peer_gone():
                raise SidecarError("the sidecar closed the connection")
            time.sleep(FULL_RING_WAIT_S)

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
        if self.duplex is not None:
            self._pull_socket(0)
            while (msg := self._ring_next()) is not None:
                self._stash(msg)
            while until_step is not None and self.acked_step < until_step:
                self._stash(self._recv(self.step_timeout_ms / 1000))
            out, self._results = self._results, []
            return out
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
        # Called every step: poll(0) is a cheap "nothing new" (no exception on the common path).
        while self._monitor.poll(0):
            if recv_monitor_message(self._monitor)["event"] == zmq.EVENT_DISCONNECTED:
                self._gone = True  # sticky: a ring wait may have seen it before the link asks
        return self._gone

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
        if self.duplex is not None:
            return self._ring_recv(timeout_s)
        try:
            if timeout_s * 1000 >= self.step_timeout_ms:
                frame = self._sock.recv()
            elif self._sock.poll(int(timeout_s * 1000)):
                frame = self._sock.recv()
            else:
                raise zmq.Again()
        except zmq.Again:
            raise self._timeout(timeout_s) from None
        return self._decode(frame)

    def _timeout(self, timeout_s: float) -> SidecarError:
        return SidecarError(
            f"omni-sidecar at {self.endpoint} did not answer within {timeout_s:.1f}s "
            "(OMNI_SIDECAR_STEP_TIMEOUT)"
        )

    # -- the ring ------------------------------------------------------------------

    def _kick(self) -> None:
        """Wake a sidecar that sleeps on its socket (an empty frame; never blocks a step)."""
        try:
            self._sock.send(b"", zmq.NOBLOCK, copy=True)
            self.kicks_sent += 1
        except zmq.Again:
            pass  # the sidecar re-checks its rings on its own within its sleep

    def _ring_recv(self, timeout_s: float) -> Message:
        """Spin (yielding) for `spin_us`, then sleep until kicked; the step timeout and the
        socket monitor end the wait early when the sidecar is late or gone."""
        duplex = self.duplex
        assert duplex is not None
        msg = self._ring_next()
        if msg is not None:
            return msg
        now = time.monotonic()
        deadline = now + timeout_s
        spin_until = now + self.ring_config.spin_us / 1e6
        while True:
            msg = self._ring_next()
            if msg is not None:
                return msg
            now = time.monotonic()
            if now >= deadline:
                raise self._timeout(timeout_s)
            if duplex.waiting_for_socket:  # a MARK: its frame is on the socket, on its way
                self._pull_socket(max(1, min(50, int((deadline - now) * 1000))))
                if not duplex.socket_frames and self.peer_gone():
                    raise SidecarError(f"omni-sidecar at {self.endpoint} closed the connection")
                continue
            if now < spin_until:
                os.sched_yield()
                continue
            duplex.rx.set_sleeping(True)
            try:
                msg = self._ring_next()  # published before it could see our flag?
                if msg is not None:
                    return msg
                if self.peer_gone():
                    raise SidecarError(f"omni-sidecar at {self.endpoint} closed the connection")
                self.sleeps += 1
                self._pull_socket(max(1, min(self.ring_config.sleep_ms, int((deadline - now) * 1000))))
            finally:
                duplex.rx.set_sleeping(False)

    def _ring_next(self) -> Message | None:
        """The next message in connection order, or None when there is none yet."""
        assert self.duplex is not None
        try:
            msg = self.duplex.recv(self._decode)
        except RingError as exc:
            raise SidecarError(f"bad shared-memory ring from the sidecar: {exc}") from None
        return None if msg is EMPTY else msg  # type: ignore[return-value]

    def _pull_socket(self, wait_ms: int) -> None:
        """Socket frames into the duplex (each behind its MARK); kicks (empty frames) dropped."""
        sock, duplex = self._sock, self.duplex
        assert duplex is not None
        if wait_ms > 0:
            sock.poll(wait_ms)
        while sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            frame = sock.recv(copy=True)
            if frame:
                duplex.feed_socket(frame)

    def close(self) -> None:
        self._close_offer()
        if self.duplex is not None:
            self.duplex.close()
            self.duplex = None
        try:
            self._sock.disable_monitor()
        except zmq.ZMQError:
            pass
        self._monitor.close(0)
        self._sock.close(0)
