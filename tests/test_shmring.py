"""The shared-memory ring fast path: the ring itself, the shim's channel on it, a real sidecar on it.

Behaviour only, never timings: what arrives, in which order, what is refused, who gets kicked.
"""

from __future__ import annotations

import os
import random
import threading
import time

import pytest
import zmq

from proto.arena import ArenaError, ShmArena
from proto.codec import Codec, FrameError
from proto.messages import (
    ErrorReply,
    Hello,
    HookNeeds,
    NewRequest,
    StepBegin,
    StepEnd,
    StepPlan,
    StepResult,
    Welcome,
)
from proto.packed import packed_layout
from proto.shmring import (
    EMPTY,
    HEADER_BYTES,
    MSG,
    RingDuplex,
    RingError,
    ShmRing,
)
from proto.version import PROTOCOL_MAJOR
from tests.support.procs import SidecarProcess
from worker_shim.wire.channel import SidecarChannel, SidecarError
from worker_shim.config import RingConfig

CODEC = Codec()
HELLO = Hello(PROTOCOL_MAJOR, 0, "t", "none", "cpu", 0, 1, "m", 8, "float32", 8, [])
WORDS = {"write": 8, "read": 16, "sleeping": 24}  # u64 slots of the ring header


@pytest.fixture
def pair():
    """A producer and a consumer mapping of one 4 KiB ring."""
    producer = ShmRing.create(4096)
    consumer = ShmRing.attach(producer.info())
    yield producer, consumer
    consumer.close()
    producer.close()


def take(ring: ShmRing) -> bytes | None:
    rec = ring.poll()
    if rec is None:
        return None
    kind, view = rec
    assert kind == MSG and view is not None
    data = bytes(view)
    ring.consume()
    return data


def poke(ring: ShmRing, slot: str, value: int) -> None:
    words = ring.arena.raw(0, HEADER_BYTES).cast("Q")
    words[WORDS[slot]] = value
    words.release()


def poke_record(ring: ShmRing, pos: int, length: int, kind: int) -> None:
    hdr = ring.arena.raw(HEADER_BYTES + pos, 8).cast("I")
    hdr[0], hdr[1] = length, kind
    hdr.release()


# -- the ring -------------------------------------------------------------------------


def test_records_of_every_size_wrap_around_intact(pair):
    producer, consumer = pair
    rng = random.Random(7)
    for i in range(3000):
        data = rng.randbytes(rng.randint(0, producer.max_record))
        assert producer.try_write(data)
        assert take(consumer) == data
        assert take(consumer) is None
    assert producer._write > 100 * producer.capacity  # wrapped many times


def test_spinning_for_data_ends_when_a_record_is_published_or_at_the_deadline(pair):
    producer, consumer = pair
    assert consumer.spin_for_data(time.monotonic() + 0.02) is False  # nothing comes: back at the deadline
    writer = threading.Timer(0.05, producer.try_write, args=(b"late",))
    writer.start()
    try:
        assert consumer.spin_for_data(time.monotonic() + 30) is True  # back when it lands, long before 30 s
    finally:
        writer.join()
    assert take(consumer) == b"late"
    assert consumer.spin_for_data(time.monotonic()) is False  # consumed: nothing left to see
    assert producer.try_write(b"there")
    assert consumer.spin_for_data(0.0) is True  # already there: True even past the deadline


def test_several_records_in_flight_keep_their_order(pair):
    producer, consumer = pair
    rng = random.Random(3)
    sent: list[bytes] = []
    for _ in range(2000):
        while True:
            data = rng.randbytes(rng.randint(0, 700))
            if not producer.try_write(data):
                break
            sent.append(data)
        for _ in range(rng.randint(1, len(sent))):
            assert take(consumer) == sent.pop(0)
    while sent:
        assert take(consumer) == sent.pop(0)
    assert take(consumer) is None


def test_a_record_larger_than_the_space_left_starts_over_at_the_beginning(pair):
    producer, consumer = pair
    for _ in range(3):  # 3 x 1008 bytes: 1072 left before the end
        assert producer.try_write(b"a" * 1000)
        take(consumer)
    assert producer.try_write(b"b" * 1000)  # fits at 3024
    take(consumer)
    big = b"c" * 1500  # 64 bytes left before the end: a pad, then the record at 0
    assert producer.try_write(big)
    assert take(consumer) == big
    assert bytes(producer.arena.raw(HEADER_BYTES + 8, 1500)) == big


def test_a_full_ring_refuses_until_the_consumer_catches_up(pair):
    producer, consumer = pair
    n = 0
    while producer.try_write(b"x" * 500):
        n += 1
    assert n == 4096 // 512 and producer.pending_bytes() == 4096
    assert not producer.try_mark()
    assert take(consumer) == b"x" * 500
    assert producer.try_write(b"y" * 500)
    with pytest.raises(ValueError, match="exceeds"):
        producer.try_write(b"z" * (producer.max_record + 1))


def test_too_big_for_the_ring_takes_the_socket_behind_a_mark_in_order():
    a_tx, b_tx = ShmRing.create(4096), ShmRing.create(4096)
    a = RingDuplex(tx=a_tx, rx=b_tx)
    b = RingDuplex(tx=ShmRing.attach(b_tx.info()), rx=ShmRing.attach(a_tx.info()))
    try:
        assert a.send(b"first") == "ring"
        big = b"B" * 5000
        assert a.send(big) == "socket"  # the caller sends `big` on the socket now
        assert a.send(b"control", control=True) == "socket"
        assert a.send(b"last") == "ring"
        got = lambda: b.recv(bytes)  # noqa: E731
        assert got() == b"first"
        assert got() is EMPTY and b.waiting_for_socket  # the mark is there, its frame not yet
        b.feed_socket(big)
        assert got() == big
        b.feed_socket(b"control")
        assert got() == b"control" and got() == b"last" and got() is EMPTY
        b.feed_socket(b"stray")  # a frame on the socket with no mark ahead of it
        with pytest.raises(RingError, match="without its ring mark"):
            got()
    finally:
        a.close()
        b.close()


def test_a_bad_record_is_consumed_and_the_ring_goes_on(pair):
    producer, consumer = pair
    duplex = RingDuplex(tx=ShmRing.create(4096), rx=consumer)
    producer.try_write(b"\xc1garbage")
    producer.try_write(CODEC.encode(StepResult(4)))
    with pytest.raises(FrameError):
        duplex.recv(CODEC.decode)
    assert duplex.recv(CODEC.decode) == StepResult(4)
    duplex.tx.close()


GARBAGE = {
    "write index past the capacity": lambda p, c: poke(p, "write", 4096 + 64),
    "write index not aligned": lambda p, c: poke(p, "write", 13),
    "write index going backwards": lambda p, c: (p.try_write(b"x"), take(c), poke(p, "write", 0)),
    "unknown record kind": lambda p, c: (p.try_write(b"x"), poke_record(p, 0, 1, 77)),
    "length past the published data": lambda p, c: (p.try_write(b"x"), poke_record(p, 0, 900, 1)),
    "length past the ring": lambda p, c: (p.try_write(b"x"), poke_record(p, 0, 1 << 31, 1)),
    "mark with a length": lambda p, c: (p.try_write(b"x"), poke_record(p, 0, 8, 2)),
    "pad that does not end the ring": lambda p, c: (p.try_write(b"x"), poke_record(p, 0, 0, 3)),
}


@pytest.mark.parametrize("case", sorted(GARBAGE))
def test_garbage_headers_are_rejected_and_the_ring_stays_refused(pair, case):
    producer, consumer = pair
    GARBAGE[case](producer, consumer)
    with pytest.raises(RingError, match="shared-memory ring"):
        consumer.poll()
    with pytest.raises(RingError):  # no resynchronising on garbage
        consumer.poll()


def test_a_garbage_read_index_is_rejected_by_the_producer(pair):
    producer, consumer = pair
    while producer.try_write(b"x" * 1000):
        pass
    poke(consumer, "read", 1 << 40)
    with pytest.raises(RingError, match="read index"):
        producer.try_write(b"x" * 1000)


def test_attach_refuses_what_is_not_a_fresh_ring():
    plain = ShmArena.create(HEADER_BYTES + 4096)
    with pytest.raises(ArenaError, match="not an omni-sidecar ring"):
        ShmRing.attach(plain.info())
    plain.close()
    used = ShmRing.create(4096)
    used.try_write(b"x")
    with pytest.raises(ArenaError, match="not fresh"):
        ShmRing.attach(used.info())
    used.close()
    tiny = ShmRing.create(4096)
    info = tiny.info()
    with pytest.raises(ArenaError, match="out of range"):
        ShmRing.attach(type(info)(info.kind, info.name, 100))
    tiny.close()


# -- the shim's channel on a ring (a fake sidecar in the test) -------------------------


class FakeSidecar:
    """A ROUTER that maps a channel's rings; the test plays the sidecar's side of them."""

    def __init__(self, tmp_path) -> None:
        self.endpoint = f"ipc://{tmp_path}/fake.sock"
        self.sock = zmq.Context.instance().socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(self.endpoint)
        self.duplex: RingDuplex | None = None
        self.ident = b""

    def accept(self, channel: SidecarChannel) -> RingDuplex:
        channel.send(HELLO)
        assert self.sock.poll(5000)
        self.ident, frame = self.sock.recv_multipart()
        hello = CODEC.decode(frame)
        assert isinstance(hello, Hello) and len(hello.rings) == 2
        self.duplex = RingDuplex(tx=ShmRing.attach(hello.rings[1]), rx=ShmRing.attach(hello.rings[0]))
        self.sock.send_multipart([self.ident, CODEC.encode(Welcome(PROTOCOL_MAJOR, 0, "fake", "x", HookNeeds(), 1, rings=True))])
        assert channel.poll_welcome(HELLO, 5000) is not None and (channel.rings is not None)
        return self.duplex

    def next_message(self, timeout_s: float = 5.0):
        assert self.duplex is not None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            msg = self.duplex.recv(CODEC.decode)
            if msg is not EMPTY:
                return msg
            if self.sock.poll(1):
                ident, frame = self.sock.recv_multipart()
                if frame:
                    self.duplex.feed_socket(frame)
        raise AssertionError("nothing arrived")

    def reply(self, msg, kick: bool = True) -> None:
        assert self.duplex is not None and self.duplex.send(CODEC.encode(msg)) == "ring"
        if kick and self.duplex.peer_sleeping():
            self.sock.send_multipart([self.ident, b""])

    def close(self) -> None:
        if self.duplex is not None:
            self.duplex.close()
        self.sock.close(0)


@pytest.fixture
def fake(tmp_path):
    f = FakeSidecar(tmp_path)
    yield f
    f.close()


def test_a_kick_goes_out_only_when_the_reader_sleeps(fake):
    channel = SidecarChannel(fake.endpoint, 5, ring=RingConfig())
    try:
        duplex = fake.accept(channel)
        channel.send(StepEnd(0))
        assert fake.next_message() == StepEnd(0)
        assert not fake.sock.poll(100) and channel.kicks_sent == 0  # awake reader: no kick
        duplex.rx.set_sleeping(True)
        channel.send(StepEnd(1))
        assert fake.sock.poll(5000)
        assert fake.sock.recv_multipart() == [fake.ident, b""]  # the kick
        assert channel.kicks_sent == 1
        assert fake.next_message() == StepEnd(1)
    finally:
        channel.close()


def test_a_missed_kick_costs_one_sleep_not_the_step_timeout(fake):
    channel = SidecarChannel(fake.endpoint, 30, ring=RingConfig(spin_us=0, sleep_ms=5))
    try:
        duplex = fake.accept(channel)

        def sidecar() -> None:
            assert isinstance(fake.next_message(), StepBegin)
            while not duplex.peer_sleeping():  # the channel went to sleep on the socket
                time.sleep(0.001)
            fake.reply(StepPlan(step=3), kick=False)  # as if the kick had been lost

        thread = threading.Thread(target=sidecar)
        thread.start()
        plan = channel.call(StepBegin(3, packed_layout(["a"], [0, 1], [0], [1])), StepPlan)
        thread.join(10)
        assert plan == StepPlan(step=3) and channel.sleeps >= 1
    finally:
        channel.close()


def test_a_sleeping_channel_wakes_on_the_kick_and_stashes_results_in_order(fake):
    channel = SidecarChannel(fake.endpoint, 30, ring=RingConfig(spin_us=0, sleep_ms=1000))
    try:
        duplex = fake.accept(channel)
        channel.send(StepEnd(0))
        channel.send(StepEnd(1))

        def sidecar() -> None:
            for step in (0, 1):
                assert fake.next_message() == StepEnd(step)
            assert isinstance(fake.next_message(), StepBegin)
            while not duplex.peer_sleeping():
                time.sleep(0.001)
            fake.reply(StepResult(0))
            fake.reply(StepResult(1))
            fake.reply(StepPlan(2))

        thread = threading.Thread(target=sidecar)
        thread.start()
        plan = channel.call(StepBegin(2, packed_layout(["a"], [0, 1], [0], [1])), StepPlan)
        thread.join(10)
        assert plan == StepPlan(2)
        assert [r.step for r in channel.take_results()] == [0, 1]
    finally:
        channel.close()


def test_a_full_ring_makes_the_writer_wait_and_then_give_up(fake):
    channel = SidecarChannel(fake.endpoint, 0.3, ring=RingConfig(capacity_kib=4))
    try:
        fake.accept(channel)
        msg = StepEnd(1, finished=["r" * 200] * 4)  # ~850 bytes: a handful fill 4 KiB
        with pytest.raises(SidecarError, match="did not drain its ring"):
            for _ in range(100):  # nobody reads
                channel.send(msg)

        def reader() -> None:
            time.sleep(0.05)
            for _ in range(3):
                assert fake.next_message() == msg

        thread = threading.Thread(target=reader)
        thread.start()
        channel.send(msg)  # waits until the reader made room
        thread.join(10)
        assert not thread.is_alive()
    finally:
        channel.close()


def test_garbage_in_the_ring_is_a_sidecar_error_for_the_shim(fake):
    channel = SidecarChannel(fake.endpoint, 5, ring=RingConfig())
    try:
        duplex = fake.accept(channel)
        fake.reply(ErrorReply("x", "y"))
        with pytest.raises(SidecarError, match="rejected"):
            channel.take_results()
        duplex.tx.try_write(b"\xc1")
        with pytest.raises(SidecarError, match="bad frame"):
            channel.take_results()
        poke(duplex.tx, "write", 12345)
        for _ in range(2):  # refused, and stays refused
            with pytest.raises(SidecarError, match="bad shared-memory ring"):
                channel.take_results()
    finally:
        channel.close()


def test_a_socket_message_without_its_mark_is_a_sidecar_error(fake):
    channel = SidecarChannel(fake.endpoint, 5, ring=RingConfig())
    try:
        fake.accept(channel)
        fake.sock.send_multipart([fake.ident, CODEC.encode(StepResult(0))])
        time.sleep(0.05)
        with pytest.raises(SidecarError, match="without its ring mark"):
            channel.take_results()
    finally:
        channel.close()


def test_the_ring_wait_notices_a_dead_sidecar_before_the_step_timeout(tmp_path):
    sidecar = SidecarProcess(f"ipc://{tmp_path}/d.sock", "passthrough", tmp_path / "sidecar.log",
                             extra_args=["--ring-spin-us", "0"])
    channel = SidecarChannel(sidecar.endpoint, 60, ring=RingConfig(spin_us=0))
    try:
        channel.handshake(HELLO, 10)
        assert channel.rings is not None
        sidecar.proc.kill()
        sidecar.proc.wait(10)
        with pytest.raises(SidecarError, match="closed the connection"):
            channel.call(StepBegin(0, packed_layout(["a"], [0, 1], [0], [1])), StepPlan)
    finally:
        channel.close()
        sidecar.stop()


# -- a real sidecar on the ring -------------------------------------------------------


def _ring_names() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith("omni-ring-") and f"-{os.getpid()}-" in n}


def test_the_sidecar_answers_over_the_ring_in_order_big_frames_included(tmp_path):
    sidecar = SidecarProcess(f"ipc://{tmp_path}/r.sock", "passthrough", tmp_path / "sidecar.log")
    channel = SidecarChannel(sidecar.endpoint, 10, ring=RingConfig(capacity_kib=64))
    try:
        welcome = channel.handshake(HELLO, 10)
        assert welcome.rings and (channel.rings is not None)
        assert _ring_names() == set()  # the sidecar mapped both rings and removed their names
        layout = packed_layout(["small", "big"], [0, 1, 2], [0, 0], [1, 1])
        plan = channel.call(StepBegin(0, layout, [NewRequest("small", 1, [1])]), StepPlan)
        assert plan.step == 0 and plan.errors == []
        channel.send(StepEnd(0, num_tokens=1))
        # Bigger than the ring: MARK + socket, and still in order with the ring messages around it.
        big = NewRequest("big", 1, [2], {"blob": b"x" * 200_000})
        channel.send(StepEnd(1, layout, [big], num_tokens=2))
        channel.send(StepEnd(2, finished=["big", "small"]))
        results = channel.take_results(until_step=2)
        assert [r.step for r in results] == [0, 1, 2] and all(r.errors == [] for r in results)
        (session,) = sidecar.status().sessions
        # Finishing before admitting would not count: the sidecar saw the three in order.
        assert session.new_requests == 2 and session.finished_requests == 2 and session.steps == 2
    finally:
        channel.close()
        sidecar.stop()


@pytest.mark.parametrize("side", ["sidecar", "shim"])
def test_rings_off_on_either_side_keeps_everything_on_zeromq(tmp_path, side):
    extra = ["--no-ring"] if side == "sidecar" else []
    sidecar = SidecarProcess(f"ipc://{tmp_path}/z.sock", "passthrough", tmp_path / "sidecar.log", extra_args=extra)
    channel = SidecarChannel(sidecar.endpoint, 10, ring=RingConfig(enabled=side == "sidecar"))
    try:
        assert not channel.handshake(HELLO, 10).rings and channel.rings is None
        assert _ring_names() == set()  # a declined offer leaves nothing in /dev/shm
        channel.send(StepEnd(0, packed_layout(["a"], [0, 1], [0], [1]), [NewRequest("a", 1, [1])], num_tokens=1))
        assert [r.step for r in channel.take_results(until_step=0)] == [0]
    finally:
        channel.close()
        sidecar.stop()


def test_no_rings_offered_where_store_order_is_not_x86s(fake, monkeypatch):
    import platform

    monkeypatch.setattr(platform, "machine", lambda: "aarch64")
    channel = SidecarChannel(fake.endpoint, 5, ring=RingConfig())
    try:
        channel.send(HELLO)
        assert fake.sock.poll(5000)
        _, frame = fake.sock.recv_multipart()
        assert CODEC.decode(frame).rings == [] and _ring_names() == set()
    finally:
        channel.close()


def test_ring_env_knobs():
    assert not RingConfig.from_env({"OMNI_SIDECAR_RING": "0"}).enabled
    cfg = RingConfig.from_env({"OMNI_SIDECAR_RING_SPIN_US": "50", "OMNI_SIDECAR_RING_SLEEP_MS": "3"})
    assert cfg.enabled and cfg.spin_us == 50 and cfg.sleep_ms == 3
    with pytest.raises(ValueError, match="OMNI_SIDECAR_RING"):
        RingConfig.from_env({"OMNI_SIDECAR_RING": "maybe"})
