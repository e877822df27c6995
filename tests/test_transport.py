"""proto/transport.py with real shared-memory rings and real ZeroMQ sockets (no vLLM, no sidecar)."""

from __future__ import annotations

import pytest
import zmq

from proto.arena import ArenaError
from proto.codec import Codec
from proto.messages import (
    ErrorReply,
    Hello,
    Pong,
    Reject,
    StatusQuery,
    StepBegin,
    StepEnd,
    StepPlan,
    StepResult,
    SwitchAck,
    Welcome,
    HookNeeds,
)
from proto.packed import packed_layout
from proto.shmring import EMPTY, RingDuplex, ShmRing
from proto.transport import RingOverflow, RingTransport, WaitPolicy, reply_problem, route
from proto.version import PROTOCOL_MAJOR

CODEC = Codec()
RING_BYTES = 16 << 10


class Pair:
    """Two ends of one connection: a ZeroMQ PAIR each, and the two rings between them."""

    def __init__(self, tmp_path, max_queued: int = 4096) -> None:
        ctx = zmq.Context.instance()
        self.a_sock, self.b_sock = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
        for s in (self.a_sock, self.b_sock):
            s.setsockopt(zmq.LINGER, 0)
        self.a_sock.bind(f"ipc://{tmp_path}/t.sock")
        self.b_sock.connect(f"ipc://{tmp_path}/t.sock")
        up, down = ShmRing.create(RING_BYTES), ShmRing.create(RING_BYTES)
        self.a_kicks = 0
        # a creates and offers the rings (the shim); b maps them from their infos (the sidecar).
        self.a = RingTransport(RingDuplex(tx=up, rx=down), self.a_sock.send, self._kick_b, max_queued)
        self.b = RingTransport.attach([up.info(), down.info()], self.b_sock.send, lambda: self._kick(self.b_sock))

    def _kick_b(self) -> bool:
        self.a_kicks += 1
        return self._kick(self.a_sock)

    @staticmethod
    def _kick(sock: zmq.Socket) -> bool:
        sock.send(b"", zmq.NOBLOCK)
        return True

    def receive_all(self, at: RingTransport, sock: zmq.Socket, want: int) -> list:
        """`want` messages in connection order, feeding socket frames behind their MARKs."""
        out, kicks = [], 0
        while len(out) < want:
            msg = at.recv(CODEC.decode)
            if msg is not EMPTY:
                out.append(msg)
                continue
            assert sock.poll(2000), f"stuck after {out}"
            if not at.feed_socket(sock.recv()):
                kicks += 1
        return out

    def close(self) -> None:
        self.a.close()
        self.b.close()
        self.a_sock.close(0)
        self.b_sock.close(0)


@pytest.fixture
def pair(tmp_path):
    p = Pair(tmp_path)
    yield p
    p.close()


def test_routing_table():
    layout = packed_layout(["a"], [0, 1], [0], [1])
    for msg in (StepBegin(0, layout), StepEnd(0), StepPlan(step=0), StepResult(step=0), ErrorReply("c", "m")):
        assert route(msg) == "ring"
    for msg in (Welcome(PROTOCOL_MAJOR, 0, "v", "h", HookNeeds(), 1), Reject("no")):
        assert route(msg) == "socket"  # the shim reads no ring before the handshake's answer
    for msg in (Pong(1), StatusQuery(), SwitchAck("ipc:///x", "t"),
                Hello(PROTOCOL_MAJOR, 0, "t", "none", "cpu", 0, 1, "m", 8, "float32", 8, [])):
        assert route(msg) == "marked"


def test_one_order_across_ring_and_socket(pair):
    big = StepPlan(step=2, extra_kwargs=b"x" * (RING_BYTES // 2))  # too big for the ring
    sent = [StepPlan(step=0), Pong(7), StepResult(step=1), big, StepResult(step=3)]
    for msg in sent:
        pair.b.send(CODEC.encode(msg), route(msg))
    assert pair.receive_all(pair.a, pair.a_sock, len(sent)) == sent


def test_socket_route_skips_the_ring(pair):
    pair.b.send(CODEC.encode(Reject("no")), "socket")
    assert pair.a.recv(CODEC.decode) is EMPTY  # no MARK in the ring
    assert pair.a_sock.poll(2000) and CODEC.decode(pair.a_sock.recv()) == Reject("no")


def test_kick_only_when_the_reader_sleeps(pair):
    pair.a.send(CODEC.encode(StepEnd(0)), "ring")
    assert pair.a.kicks_sent == 0 and not pair.b_sock.poll(50)
    pair.b.set_sleeping(True)
    pair.a.send(CODEC.encode(StepEnd(1)), "ring")
    pair.b.set_sleeping(False)
    assert pair.a.kicks_sent == 1
    assert pair.b_sock.poll(2000) and not pair.b.feed_socket(pair.b_sock.recv())  # the kick: nothing to read
    assert pair.receive_all(pair.b, pair.b_sock, 2) == [StepEnd(0), StepEnd(1)]


def test_full_ring_queues_in_order_and_flushes_later(pair):
    frames = [CODEC.encode(StepResult(step=i, hook_us=float(i))) for i in range(2000)]
    for frame in frames:
        pair.b.send(frame, "ring")
    assert len(pair.b.queued) > 0  # more than the ring holds
    got = []
    while len(got) < len(frames):
        msg = pair.a.recv(CODEC.decode)
        if msg is EMPTY:
            pair.b.flush()
            continue
        got.append(msg.step)
    assert got == list(range(2000)) and not pair.b.queued


def test_a_reader_that_stops_overflows_the_queue(tmp_path):
    p = Pair(tmp_path, max_queued=3)
    try:
        frame = CODEC.encode(StepEnd(0, hidden_event=-1, shim_exchange_us=1.0))
        with pytest.raises(RingOverflow, match="wait for room"):
            for _ in range(RING_BYTES):
                p.a.send(frame, "ring")
    finally:
        p.close()


def test_attach_refuses_anything_but_two_rings():
    ring = ShmRing.create(RING_BYTES)
    try:
        with pytest.raises(ArenaError, match="expected 2 rings"):
            RingTransport.attach([ring.info()], lambda f: None, lambda: True)
    finally:
        ring.close()


def test_sleep_raises_flags_rechecks_then_blocks(pair):
    seen = []

    def block():
        seen.append(pair.a.duplex.peer_sleeping())  # b's flag as a writer sees it

    assert WaitPolicy.sleep([pair.b], lambda: None, block) is None
    assert seen == [True] and not pair.a.duplex.peer_sleeping()
    # A message published just before the flag went up is found by the re-check: no sleep.
    pair.a.send(CODEC.encode(StepEnd(4)), "ring")

    def recheck():
        msg = pair.b.recv(CODEC.decode)
        return None if msg is EMPTY else msg

    found = WaitPolicy.sleep([pair.b], recheck, lambda: seen.append("slept"))
    assert found == StepEnd(4) and seen == [True] and not pair.a.duplex.peer_sleeping()


def test_wait_policy_spins_then_naps_and_stretches_when_idle():
    policy = WaitPolicy(spin_us=1000, sleep_ms=2, idle_s=1.0, idle_sleep_ms=50)
    assert policy.spin(busy_at=10.0, now=10.0005)
    assert not policy.spin(busy_at=10.0, now=10.002)
    assert policy.spin(busy_at=10.0, now=10.004, window_s=0.005)  # a stretched window (proto/transport.py, SpinWindow)
    assert policy.nap_ms(busy_at=10.0, now=10.5) == 2
    assert policy.nap_ms(busy_at=10.0, now=11.5) == 50  # idle: fewer wake-ups
    assert policy.nap_ms(busy_at=10.0, now=11.5, deadline=11.53125) == 31  # never past the deadline
    assert policy.nap_ms(busy_at=10.0, now=10.5, deadline=10.5) == 1


def test_reply_problem_names_what_is_wrong():
    assert reply_problem(StatusQuery(), Pong(1), Pong) == ""
    assert reply_problem(StatusQuery(), ErrorReply("no_session", "say Hello"), Pong) == (
        "sidecar rejected StatusQuery: no_session: say Hello")
    assert reply_problem(StatusQuery(), StepPlan(step=1), Pong) == "expected Pong, sidecar sent StepPlan"
