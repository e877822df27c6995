"""Single-producer/single-consumer byte rings in POSIX shared memory (the per-step fast path).

Why: a ZeroMQ round trip costs two kernel wake-ups plus libzmq's I/O-thread hops
(docs/ARCHITECTURE.md, Rings); a ring that the waiting side polls costs a few microseconds. One ring
per direction per connection; the shim creates both (0600, `ShmArena`), offers them
in its Hello, and the sidecar maps them and removes their names. The socket stays
for the handshake, control, heartbeats and *kicks* (an empty frame that wakes a
reader that went to sleep).

Layout (offsets in bytes; every shared word is a native, 8-byte-aligned u64):

    0    magic                      written once by the creator
    8    capacity                   bytes in the data area
    64   write index                only the producer writes it
    128  read index                 only the consumer writes it
    192  consumer sleeping flag     only the consumer writes it (1: kick me)
    256  data area                  records, 8-byte aligned

The indices count bytes since creation and only grow; position = index % capacity.
A record is an 8-byte header (u32 length, u32 kind) and its payload padded to 8
bytes. Kinds: MSG (a msgspec frame), MARK ("the next message of this connection is
on the socket": a frame too big for the ring, or a control message; keeps one
order per connection across the two transports), PAD (skip to the end of the data
area: records never wrap, so a reader decodes them in place).

Memory order: the producer writes the payload and header, then publishes the
write index; the consumer reads the index, then the record, then publishes the
read index. Each index is one aligned 8-byte store/load (memoryview of 'Q': a
fixed-size memcpy, one instruction on x86-64). This relies on x86-64 TSO (stores
become visible in program order, loads are not reordered with older loads or
younger stores). ARM/POWER would need a release fence before publishing and an
acquire fence after reading an index, which Python cannot express: do not enable
rings there without a fenced (C) publisher. TSO does reorder a store before a
later load (store buffer), so "write index, then read the sleeping flag" can miss
a consumer that is just falling asleep: sleepers therefore block with a short
timeout and re-check the ring, so a missed kick costs at most that timeout.

Everything read from the shared area is untrusted (the peer may be buggy or
hostile): indices and headers are bounds-checked and any inconsistency raises
`RingError`; the ring is then unusable and the connection is dropped. A peer with
our uid can also truncate the file under our mapping (SIGBUS); the same uid can
ptrace us anyway, which is why only that uid may connect.
"""

from __future__ import annotations

import collections
import os
import time
from typing import Callable, Literal, TypeVar

from proto.arena import ArenaError, ShmArena
from proto.errors import ProtoError
from proto.messages import ArenaInfo

MAGIC = 0x3147_4E49_5249_4E4F  # "ONIRING1" little-endian
HEADER_BYTES = 256
_MAGIC, _CAPACITY, _WRITE, _READ, _SLEEPING = 0, 1, 8, 16, 24  # u64 slots of the header
REC_HEADER = 8
MSG, MARK, PAD = 1, 2, 3
_MSG_KIND_WORD = MSG << 32  # a MSG header as one u64: length in the low half, kind in the high one
MIN_CAPACITY = 4 << 10
MAX_CAPACITY = 256 << 20
DEFAULT_CAPACITY = 1 << 20

T = TypeVar("T")


class RingError(ProtoError, RuntimeError):
    """The shared ring holds something a correct peer never writes; the ring is unusable."""


class ShmRing:
    """One direction of a connection. The same object serves its producer or its consumer."""

    def __init__(self, arena: ShmArena, capacity: int) -> None:
        self.arena = arena
        self.capacity = capacity
        # Records up to half the ring: a bigger one could wait on the consumer forever
        # behind a wrap-around pad. Bigger frames take the socket (after a MARK).
        self.max_record = capacity // 2 - REC_HEADER
        self._mv = arena.raw(0, HEADER_BYTES + capacity)
        self._words = self._mv[:HEADER_BYTES].cast("Q")
        self._hdr = self._mv[HEADER_BYTES:].cast("I")  # u32 view of the data area
        self._hdr64 = self._mv[HEADER_BYTES:].cast("Q")  # u64 view: a record header in one store
        self._data = self._mv[HEADER_BYTES:]
        self._write = int(self._words[_WRITE])  # our copy when we produce
        self._read = int(self._words[_READ])  # our copy when we consume
        self._peer_read = self._read  # last read index seen from the consumer
        self._view: memoryview | None = None
        self._polled = 0  # bytes the record `poll` returned occupies
        self.broken = ""

    # -- set-up --------------------------------------------------------------

    @classmethod
    def create(cls, capacity: int = DEFAULT_CAPACITY, prefix: str = "omni-ring") -> "ShmRing":
        if not MIN_CAPACITY <= capacity <= MAX_CAPACITY or capacity % 8:
            raise ArenaError(f"ring capacity {capacity}: use a multiple of 8 in [{MIN_CAPACITY}, {MAX_CAPACITY}]")
        arena = ShmArena.create(HEADER_BYTES + capacity, prefix=prefix)
        words = arena.raw(0, HEADER_BYTES).cast("Q")
        words[_CAPACITY] = capacity
        words[_MAGIC] = MAGIC
        words.release()
        return cls(arena, capacity)

    @classmethod
    def attach(cls, info: ArenaInfo) -> "ShmRing":
        """Map the peer's ring (and remove its name); refuse anything that is not one."""
        if not HEADER_BYTES + MIN_CAPACITY <= info.size <= HEADER_BYTES + MAX_CAPACITY:
            raise ArenaError(f"ring {info.name!r}: size {info.size} out of range")
        arena = ShmArena.attach(info)
        try:
            words = arena.raw(0, HEADER_BYTES).cast("Q")
            magic, capacity = int(words[_MAGIC]), int(words[_CAPACITY])
            write, read = int(words[_WRITE]), int(words[_READ])
            words.release()
            if magic != MAGIC:
                raise ArenaError(f"{info.name!r} is not an omni-sidecar ring (magic {magic:#x})")
            if capacity != info.size - HEADER_BYTES or capacity % 8:
                raise ArenaError(f"ring {info.name!r}: capacity {capacity} does not match its size {info.size}")
            if write != read or write % 8:
                raise ArenaError(f"ring {info.name!r} is not fresh (write {write}, read {read})")
            return cls(arena, capacity)
        except BaseException:
            arena.close()
            raise

    def info(self) -> ArenaInfo:
        return self.arena.info()

    def close(self) -> None:
        for mv in (self._view, self._words, self._hdr, self._hdr64, self._data, self._mv):
            if mv is not None:
                mv.release()
        self._view = None
        self.arena.close()

    # -- producer --------------------------------------------------------------

    def try_write(self, payload: bytes | memoryview) -> bool:
        """Publish one MSG record; False when there is no room yet (nothing half-written)."""
        n = len(payload)
        if n > self.max_record:
            raise ValueError(f"{n}-byte record exceeds the ring's {self.max_record}-byte limit")
        total = REC_HEADER + ((n + 7) & ~7)
        write, capacity = self._write, self.capacity
        pos = write % capacity
        # Every step writes two small records: when one fits before the end and in the room last
        # seen, publish it inline (`_reserve` and `_publish` unrolled: a Python call costs more
        # than the copy); otherwise the general path (PAD, a fresh look at the read index).
        if total > capacity - pos or capacity - (write - self._peer_read) < total:
            pos = self._reserve(total)
            if pos < 0:
                return False
            start = pos + REC_HEADER
            self._data[start : start + n] = payload
            self._publish(pos, n, MSG)
            return True
        start = pos + REC_HEADER
        self._data[start : start + n] = payload
        self._hdr64[pos >> 3] = n | _MSG_KIND_WORD  # length and kind in one store (x86-64: little-endian)
        self._write = write = write + total
        self._words[_WRITE] = write  # the publishing store: after payload and header
        return True

    def try_mark(self) -> bool:
        """Publish a MARK: the peer takes its next message from the socket."""
        pos = self._reserve(REC_HEADER)
        if pos < 0:
            return False
        self._publish(pos, 0, MARK)
        return True

    def peer_sleeping(self) -> bool:
        return self._words[_SLEEPING] != 0

    def pending_bytes(self) -> int:
        """Bytes the consumer has not consumed yet (producer side)."""
        self._peer_read_index()
        return self._write - self._peer_read

    def _reserve(self, total: int) -> int:
        """Position for a record of `total` bytes (after a PAD if it would cross the end); -1: full.

        total <= capacity / 2 (max_record), so a record that needs the PAD still fits
        once the consumer has caught up: the writer never waits forever.
        """
        pos = self._write % self.capacity
        tail = self.capacity - pos
        need = total if total <= tail else tail + total
        if self.capacity - (self._write - self._peer_read) < need:
            if self.capacity - (self._write - self._peer_read_index()) < need:
                return -1
        if total > tail:
            self._publish(pos, tail - REC_HEADER, PAD)
            pos = 0
        return pos

    def _publish(self, pos: int, length: int, kind: int) -> None:
        i = pos >> 2
        self._hdr[i] = length
        self._hdr[i + 1] = kind
        self._write += REC_HEADER + ((length + 7) & ~7)
        self._words[_WRITE] = self._write  # the publishing store: after payload and header

    def _peer_read_index(self) -> int:
        read = int(self._words[_READ])
        if read < self._peer_read or read > self._write or read % 8:
            raise self.fail(f"consumer's read index {read} is outside [{self._peer_read}, {self._write}]")
        self._peer_read = read
        return read

    # -- consumer --------------------------------------------------------------

    def poll(self) -> tuple[int, memoryview | None] | None:
        """The next record as (MSG, payload view) or (MARK, None); None when empty.

        The view stays valid until `consume()`; PAD records are skipped here.
        """
        if self.broken:
            raise RingError(self.broken)
        capacity, hdr = self.capacity, self._hdr
        while True:
            write = self._words[_WRITE]  # a 'Q' view yields an int: no int() needed (per poll)
            read = self._read
            if write == read:
                return None
            if write < read or write - read > capacity or write % 8:
                raise self.fail(f"producer's write index {write} is outside [{read}, {read + capacity}]")
            pos = read % capacity
            i = pos >> 2
            length, kind = hdr[i], hdr[i + 1]
            tail = capacity - pos
            if kind == PAD:
                if length != tail - REC_HEADER or write - read < tail:
                    raise self.fail(f"pad record of {length} bytes at {pos} does not end the ring")
                self._advance(tail)
                continue
            if kind == MARK:
                if length != 0:
                    raise self.fail(f"mark record with length {length}")
                self._polled = REC_HEADER
                return MARK, None
            if kind != MSG:
                raise self.fail(f"unknown record kind {kind} at {pos}")
            total = REC_HEADER + ((length + 7) & ~7)
            if length > self.max_record or total > tail or total > write - read:
                raise self.fail(f"record of {length} bytes at {pos} exceeds the published data")
            start = pos + REC_HEADER
            self._polled = total
            self._view = self._data[start : start + length]
            return MSG, self._view

    def has_data(self) -> bool:
        """Anything published past what we consumed (one shared load; `poll` checks it)."""
        return self._words[_WRITE] != self._read

    def spin_for_data(self, until: float) -> bool:
        """Watch the write index until something is published or the monotonic clock passes `until`:
        one shared load and a sched_yield a turn (a reply usually lands within a waiter's spin window,
        and a turn of anything more costs more than the load). True when something is there."""
        words, read, clock, give_way = self._words, self._read, time.monotonic, os.sched_yield
        while words[_WRITE] == read:
            if clock() >= until:
                return False
            give_way()
        return True

    def consume(self) -> None:
        """Done with the record `poll` returned: the producer may reuse its bytes."""
        if self._view is not None:
            try:
                self._view.release()
            except BufferError:  # a decoder kept a view of it; the mapping outlives it anyway
                pass
            self._view = None
        if self._polled:
            self._advance(self._polled)
            self._polled = 0

    def set_sleeping(self, sleeping: bool) -> None:
        self._words[_SLEEPING] = 1 if sleeping else 0

    def _advance(self, nbytes: int) -> None:
        self._read += nbytes
        self._words[_READ] = self._read

    def fail(self, what: str) -> RingError:
        """Mark the ring unusable (no resynchronising on garbage) and return the error to raise."""
        self.broken = f"shared-memory ring {self.arena.name}: {what}"
        return RingError(self.broken)


SendOutcome = Literal["ring", "socket", "full"]
EMPTY = object()  # `RingDuplex.recv`: nothing to read right now


class RingDuplex:
    """One connection's two rings, one order across ring and socket.

    Sending: a frame that fits goes into the ring; a bigger one (or a control
    message) leaves a MARK in the ring and then takes the socket. Receiving:
    records in ring order; a MARK is satisfied by the next frame this connection
    received on the socket (`feed_socket`). A socket frame with no MARK ahead of it
    is a protocol error: the peer published the MARK before sending, so it is
    always visible by the time its frame arrives.
    """

    def __init__(self, tx: ShmRing, rx: ShmRing) -> None:
        self.tx = tx
        self.rx = rx
        self.socket_frames: collections.deque[bytes] = collections.deque()
        self.waiting_for_socket = False  # a MARK is at the head of rx, its frame not here yet

    def send(self, frame: bytes, control: bool = False) -> SendOutcome:
        """Ring if it fits; "socket": the caller sends `frame` on the socket now; "full": retry later."""
        if not control and len(frame) <= self.tx.max_record:
            return "ring" if self.tx.try_write(frame) else "full"
        return "socket" if self.tx.try_mark() else "full"

    def peer_sleeping(self) -> bool:
        return self.tx.peer_sleeping()

    def feed_socket(self, frame: bytes) -> None:
        self.socket_frames.append(frame)

    def recv(self, decode: Callable[[bytes | memoryview], T]) -> T | object:
        """The next message in connection order, decoded; `EMPTY` if none is available now.

        A record is consumed even when `decode` raises (the frame was bad, the ring is not).
        """
        rec = self.rx.poll()
        if rec is None:
            self.waiting_for_socket = False
            if self.socket_frames:
                raise self.rx.fail("a message arrived on the socket without its ring mark")
            return EMPTY
        kind, view = rec
        if kind == MARK:
            if not self.socket_frames:
                self.waiting_for_socket = True
                return EMPTY
            self.waiting_for_socket = False
            self.rx.consume()
            return decode(self.socket_frames.popleft())
        assert view is not None
        try:
            return decode(view)
        finally:
            self.rx.consume()

    def close(self) -> None:
        self.tx.close()
        self.rx.close()
