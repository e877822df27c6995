"""The shim's link to its sidecar: handshake, blocking calls, async sends.

StepEnd is sent without waiting; its StepResult is collected later (stashed
when it arrives while waiting for something else). The sidecar answers one
connection in order, so results arrive in step order. Every frame from the
sidecar is untrusted: anything malformed becomes a SidecarError, never a crash.
A socket monitor tells the shim at once when the sidecar's end goes away.

Fast path: the Hello offers two shared-memory rings (proto/shmring.py); once the
Welcome accepts them, messages travel as proto/transport.py routes them (step
messages in the rings; control behind a ring MARK on the socket) and waiting for a
reply follows its WaitPolicy: spin, then sleep until kicked, ending early on the step
timeout or when the socket monitor says the sidecar is gone. OMNI_SIDECAR_RING=0, or a
sidecar that does not accept rings, keeps everything on ZeroMQ. See docs/ARCHITECTURE.md (transport).
"""

from __future__ import annotations

import logging
import platform
import select
import time

import msgspec
import zmq
from zmq.utils.monitor import recv_monitor_message

from proto.arena import ArenaError
from proto.codec import Codec, FrameError
from proto.errors import ProtoError
from proto.messages import (ErrorReply, Hello, Message, MirrorUpdate, Ping, Pong, Reject, StepResult, StepStart, StepTick,
                            SwitchAck, Welcome)
from proto.shmring import EMPTY, RingDuplex, RingError, ShmRing
from proto.transport import RingTransport, WaitPolicy, apply_curve_client, reply_problem, set_heartbeats
from worker_shim.config import RingConfig
from worker_shim.errors import SidecarError

log = logging.getLogger("vllm.omni_sidecar.shim.channel")
FULL_RING_WAIT_S = 0.0002
TSO_MACHINES = ("x86_64", "amd64")  # where the rings' store order holds without fences
_STASHED = (StepResult, MirrorUpdate)  # a tuple: isinstance of a union is slower (checked per reply)
_NOT_PLAIN_ANSWERS = (StepResult, MirrorUpdate, Pong, SwitchAck)  # `call` looks at these more closely
MONITOR_ASK_S = 0.5  # ask ZeroMQ about the monitor at least this often, signal or not
MARK_WAIT_MS = 50  # a MARK's frame is already on its way: wait for it in short steps
SOCKET_LOOK_S = 0.05  # with rings: read the socket at least this often when taking results, MARK or not


class SidecarChannel:
    def __init__(self, endpoint: str, step_timeout_s: float, curve_keys: str | None = None,
                 ring: RingConfig | None = None) -> None:
        self.endpoint = endpoint
        self.ring_config = ring if ring is not None else RingConfig.from_env()
        self.wait = WaitPolicy(spin_us=self.ring_config.spin_us, sleep_ms=self.ring_config.sleep_ms)
        self._offer: tuple[ShmRing, ShmRing] | None = None  # (to sidecar, from sidecar) until Welcome
        self.rings: RingTransport | None = None  # set once the sidecar accepted the rings
        self._gone = False
        self.sleeps = 0
        self.step_timeout_ms = int(step_timeout_s * 1000)
        self.codec = Codec()
        self._sock = zmq.Context.instance().socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        # A blocking recv with a timeout costs one wake-up; poll() + recv() costs two.
        self._sock.setsockopt(zmq.RCVTIMEO, self.step_timeout_ms)
        set_heartbeats(self._sock)  # a sidecar that stops answering is gone even while vLLM idles
        self._monitor = self._sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        # ZeroMQ's edge-triggered signal: the monitor's FD turns readable when news arrive after a
        # read found nothing; that first read (the poll below) arms it.
        self._monitor_news = select.poll()
        self._monitor_news.register(self._monitor.getsockopt(zmq.FD), select.POLLIN)
        self._monitor.poll(0)
        self._monitor_asked_at = time.monotonic()
        self._socket_look_due = 0.0  # the next `take_results` that reads the socket without a MARK
        if curve_keys:
            apply_curve_client(self._sock, curve_keys)
        self._sock.connect(endpoint)
        self._results: list[StepResult] = []
        self._welcome: Welcome | None = None
        self.acked_step = -1  # highest step whose StepResult arrived
        self.switch_ack: SwitchAck | None = None  # sent unsolicited when the sidecar handed us over idle
        self.switch_to = ""  # a result asked us to switch to this sidecar at the next step boundary
        self.mirror_updates: list[MirrorUpdate] = []  # unsolicited; applied at the next step start
        # StepStarts sent with `answer` whose Pong has not arrived: awaited later in the step, at its
        # one wait (docs/ARCHITECTURE.md, Hot upgrade); a Pong read meanwhile settles one.
        self.pongs_due = 0

    @property
    def kicks_sent(self) -> int:
        return self.rings.kicks_sent if self.rings is not None else 0

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
                self.rings = RingTransport(RingDuplex(tx=offer[0], rx=offer[1]), self._send_frame, self._kick)
                log.info("omni-sidecar session %d: step messages over shared-memory rings (%d KiB each way)",
                         reply.session, self.ring_config.capacity_kib)
            else:  # a sidecar started with rings off: ZeroMQ only
                for ring in offer:
                    ring.close()
        return reply

    def _offer_rings(self, hello: Hello) -> Hello:
        """Create this connection's two rings and name them in the Hello (fresh ones per Hello)."""
        if not self.ring_config.enabled or self.rings is not None:
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

    # -- traffic -----------------------------------------------------------------

    def send(self, msg: Message) -> None:
        if isinstance(msg, Hello):
            msg = self._offer_rings(msg)
        frame = self.codec.encode(msg)
        if self.rings is None:
            self._send_frame(frame)
        else:
            self._ring_send(frame, msg)

    def send_quiet(self, msg: StepStart | StepTick) -> None:
        """`send` for a step message that wakes nobody (a StepStart wanting no answer, a StepTick):
        one ring write when it fits, with none of `send`'s routing (the two every step sends)."""
        frame = self.codec.encode(msg)
        rings = self.rings
        if rings is None:
            self._send_frame(frame)
        elif not rings.send_quiet(frame):
            self._ring_send(frame, msg)

    def _send_frame(self, frame: bytes) -> None:
        self._sock.send(frame, copy=True)

    def _kick(self) -> bool:
        """Wake a sidecar that sleeps on its socket (an empty frame; never blocks a step)."""
        try:
            self._sock.send(b"", zmq.NOBLOCK, copy=True)
            return True
        except zmq.Again:
            return False  # the sidecar re-checks its rings on its own within its sleep

    def _ring_send(self, frame: bytes, msg: Message) -> None:
        """As the transport routes it; waits while the ring is full, as long as a reply may take."""
        rings = self.rings
        assert rings is not None
        try:
            rings.send_message(frame, msg)
            if not rings.queued:  # every step message, unless the ring is full
                return
            deadline = time.monotonic() + self.step_timeout_ms / 1000
            while rings.queued:  # the sidecar is behind on this connection
                if time.monotonic() > deadline:
                    raise SidecarError(
                        f"omni-sidecar at {self.endpoint} did not drain its ring within "
                        f"{self.step_timeout_ms / 1000:.1f}s (OMNI_SIDECAR_STEP_TIMEOUT)"
                    )
                if self.peer_gone():
                    raise SidecarError("the sidecar closed the connection")
                time.sleep(FULL_RING_WAIT_S)
                rings.flush()
        except ProtoError as exc:  # a broken ring
            raise SidecarError(f"bad shared-memory ring: {exc}") from None

    def call(self, msg: Message, want: type) -> Message:
        self.send(msg)
        return self.answer(msg, want)

    def answer(self, msg: Message, want: type) -> Message:
        """The reply to `msg`, sent before (by `call`, or a send of its own when the answer is taken
        later: the early StepBegin); replies owed to earlier messages are stashed on the way."""
        while True:
            reply = self._recv(self.step_timeout_ms / 1000)
            if type(reply) is want and not isinstance(reply, _NOT_PLAIN_ANSWERS):  # the usual answer
                return reply
            if isinstance(reply, _STASHED) or self._answers_step_start(reply, msg):
                self._stash(reply)
                continue
            if isinstance(reply, SwitchAck) and want is not SwitchAck:
                self._stash(reply)  # sent before our message was read: no other answer comes
                raise SidecarError("the sidecar handed this session over to its successor")
            problem = reply_problem(msg, reply, want)
            if problem:
                raise SidecarError(problem)
            return reply

    def _answers_step_start(self, reply: Message, request: Message) -> bool:
        """A Pong owed to a StepStart, not the answer to `request` (a Ping's Pong carries its nonce)."""
        return (isinstance(reply, Pong) and self.pongs_due > 0
                and not (isinstance(request, Ping) and reply.nonce == request.nonce))

    def await_pongs(self) -> None:
        """Wait for the Pongs owed to StepStarts; SidecarError (with `switch_ack` set) when the sidecar
        handed this session over before it read them: they never come."""
        while self.pongs_due > 0:
            if self.switch_ack is not None:
                raise SidecarError("the sidecar handed this session over to its successor")
            self._stash(self._recv(self.step_timeout_ms / 1000))

    def take_results(self, until_step: int | None = None) -> list[StepResult]:
        """Results received so far; blocks (up to the step timeout) for `until_step`'s."""
        if self.rings is not None:
            self._drain_ring()
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
        # Called every step: a poll of the monitor's FD is the cheap "nothing new" (<1 us; ZeroMQ's
        # own poll costs a few); only when it signals, ask ZeroMQ and drain every event.
        if self._gone:
            return True
        now = time.monotonic()
        if not self._monitor_news.poll(0) and now < self._monitor_asked_at + MONITOR_ASK_S:
            return False
        self._monitor_asked_at = now  # also asked now and then: a missed signal costs no more than that
        while self._monitor.poll(0):
            if recv_monitor_message(self._monitor)["event"] == zmq.EVENT_DISCONNECTED:
                self._gone = True  # sticky: a ring wait may have seen it before the link asks
        return self._gone

    def _stash(self, msg: Message) -> None:
        if isinstance(msg, StepResult):
            self._results.append(msg)
            self.acked_step = max(self.acked_step, msg.step)
            if msg.switch_to:
                self.switch_to = msg.switch_to
        elif isinstance(msg, SwitchAck):
            self.switch_ack = msg  # the sidecar handed this idle session over: switch at the next step
        elif isinstance(msg, MirrorUpdate):
            self.mirror_updates.append(msg)
        elif isinstance(msg, Pong) and self.pongs_due > 0:
            self.pongs_due -= 1  # the sidecar read that StepStart before it could hand the session over
        elif isinstance(msg, ErrorReply):
            if self.switch_ack is not None:
                return  # the sidecar let this session go: what we sent since was not for it
            raise SidecarError(f"sidecar rejected a step message: {msg.code}: {msg.message}")
        else:
            raise SidecarError(f"unexpected {type(msg).__name__} from the sidecar")

    def _decode(self, frame: bytes | memoryview) -> Message:
        try:
            return self.codec.decode(frame)
        except FrameError as exc:
            raise SidecarError(f"bad frame from the sidecar: {exc}") from None

    def _recv(self, timeout_s: float) -> Message:
        if self.rings is not None:
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

    # -- replies from the rings -------------------------------------------------

    def poll_ring_results(self) -> list[StepResult]:
        """Results waiting in the ring now, socket untouched (a frame behind a MARK waits for the
        next `take_results`); without rings, `take_results`."""
        rings = self.rings
        if rings is None:
            return self.take_results()
        if not self._results and rings.nothing_to_read():  # most steps: one look at the ring's indices
            return []
        while (msg := self._ring_next()) is not None:
            self._stash(msg)
        if not self._results:
            return []
        out, self._results = self._results, []
        return out

    def _drain_ring(self) -> None:
        """Stash every message that arrived, in connection order. The socket is read when a MARK
        says a message waits there, else at most every SOCKET_LOOK_S: every other frame on it is a
        kick, or a frame a broken peer sent without its MARK (found then). Asking ZeroMQ costs a
        few µs, and a StepEnd step looks here each step."""
        rings = self.rings
        assert rings is not None
        now = time.monotonic()
        if now >= self._socket_look_due:
            self._socket_look_due = now + SOCKET_LOOK_S
            self._pull_socket(0)
        while True:
            msg = self._ring_next()
            if msg is not None:
                self._stash(msg)
            elif not rings.waiting_for_socket:
                return
            else:
                self._pull_socket(0)
                if not rings.socket_frames_waiting:
                    return  # the MARK's frame is not here yet: a later look takes it

    def _ring_recv(self, timeout_s: float) -> Message:
        """Spin, then sleep until kicked (WaitPolicy); the step timeout and the socket
        monitor end the wait early when the sidecar is late or gone."""
        rings = self.rings
        assert rings is not None
        rx = rings.duplex.rx
        busy_at = time.monotonic()
        deadline = busy_at + timeout_s
        # The reply usually comes within the spin window: until then watch only the ring's write
        # index, not the whole loop below.
        rx.spin_for_data(min(deadline, busy_at + self.wait.spin_us / 1e6))
        while True:
            msg = self._ring_next()
            if msg is not None:
                return msg
            now = time.monotonic()
            if now >= deadline:
                raise self._timeout(timeout_s)
            if rings.waiting_for_socket:  # a MARK: its frame is on the socket, on its way
                self._pull_socket(max(1, min(MARK_WAIT_MS, int((deadline - now) * 1000))))
                if not rings.socket_frames_waiting and self.peer_gone():
                    raise SidecarError(f"omni-sidecar at {self.endpoint} closed the connection")
                continue
            if self.wait.spin(busy_at, now):
                continue
            nap_ms = self.wait.nap_ms(busy_at, now, deadline)
            msg = self.wait.sleep([rings], self._ring_next, lambda: self._nap(nap_ms))
            if msg is not None:
                return msg

    def _nap(self, wait_ms: int) -> None:
        if self.peer_gone():
            raise SidecarError(f"omni-sidecar at {self.endpoint} closed the connection")
        self.sleeps += 1
        self._pull_socket(wait_ms)

    def _ring_next(self) -> Message | None:
        """The next message in connection order, or None when there is none yet."""
        assert self.rings is not None
        try:
            msg = self.rings.duplex.recv(self.codec.decode)  # RingTransport.recv, one layer less per poll
        except FrameError as exc:
            raise SidecarError(f"bad frame from the sidecar: {exc}") from None
        except RingError as exc:
            raise SidecarError(f"bad shared-memory ring from the sidecar: {exc}") from None
        return None if msg is EMPTY else msg  # type: ignore[return-value]

    def _pull_socket(self, wait_ms: int) -> None:
        """Socket frames into the rings' order (each behind its MARK); kicks dropped."""
        sock, rings = self._sock, self.rings
        assert rings is not None
        if wait_ms > 0:
            sock.poll(wait_ms)
        while sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            rings.feed_socket(sock.recv(copy=True))

    def close(self) -> None:
        self._close_offer()
        if self.rings is not None:
            self.rings.close()
            self.rings = None
        try:
            self._sock.disable_monitor()
        except zmq.ZMQError:
            pass
        self._monitor.close(0)
        self._sock.close(0)
