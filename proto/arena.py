"""Shared-memory tensor arenas (POSIX shm, standard library only).

An arena is created once per connection and direction and opened once by the
peer; per step only offsets travel. The creator makes it 0600. The peer
unlinks the name as soon as it has mapped it, so a crash of either side
leaves nothing behind in /dev/shm. A CUDA IPC arena (omni_arena/cuda_ipc.py) implements the
same `Arena` protocol with device memory.
"""

from __future__ import annotations

import mmap
import os
import re
import secrets
from typing import Protocol

from proto.messages import ArenaInfo, ArenaKind
from proto.tensors import TensorRef, check_ref

SHM_DIR = "/dev/shm"
_NAME_RE = re.compile(r"^[A-Za-z0-9._-]{1,200}$")
ALIGN = 64


class ArenaError(RuntimeError):
    pass


class Arena(Protocol):
    """What both sides hold for a shared buffer: `ShmArena` here, `CudaIpcArena` in omni_arena.

    `kind` tells them apart (host memory is read through `view`, device memory through the
    arena's own tensor methods and events); code never needs isinstance for it.
    """

    kind: ArenaKind
    name: str
    size: int

    def info(self) -> ArenaInfo: ...

    def close(self) -> None: ...


def align_up(n: int, align: int = ALIGN) -> int:
    return (n + align - 1) // align * align


class ShmArena:
    """A file in /dev/shm mapped read-write into this process."""

    kind: ArenaKind = "shm"

    def __init__(self, name: str, size: int, mm: mmap.mmap, owner: bool) -> None:
        self.name = name
        self.size = size
        self._mm = mm
        self._mv = memoryview(mm)
        self._owner = owner

    @classmethod
    def create(cls, size: int, prefix: str = "omni-sidecar") -> "ShmArena":
        if size <= 0:
            raise ArenaError(f"arena size must be positive, got {size}")
        name = f"{prefix}-n{PID_NAMESPACE}-{os.getpid()}-{secrets.token_hex(6)}"
        path = os.path.join(SHM_DIR, name)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, size)
            mm = mmap.mmap(fd, size)
        except BaseException:
            os.unlink(path)
            raise
        finally:
            os.close(fd)
        return cls(name, size, mm, owner=True)

    @classmethod
    def attach(cls, info: ArenaInfo, unlink: bool = True) -> "ShmArena":
        """Open the peer's arena; by default remove its name once mapped."""
        if info.kind != "shm":
            raise ArenaError(f"arena kind {info.kind!r} is not shared memory")
        if not _NAME_RE.match(info.name):
            raise ArenaError(f"invalid arena name {info.name!r}")
        path = os.path.join(SHM_DIR, info.name)
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:
            raise ArenaError(f"arena {info.name!r} not found in {SHM_DIR}") from None
        try:
            actual = os.fstat(fd).st_size
            if actual < info.size or info.size <= 0:
                raise ArenaError(
                    f"arena {info.name!r} has {actual} bytes, peer announced {info.size}"
                )
            mm = mmap.mmap(fd, info.size)
        finally:
            os.close(fd)
        if unlink:
            _unlink_quietly(path)
        return cls(info.name, info.size, mm, owner=False)

    def info(self) -> ArenaInfo:
        return ArenaInfo(kind="shm", name=self.name, size=self.size)

    def view(self, ref: TensorRef) -> memoryview:
        check_ref(ref, self.size)
        return self._mv[ref.offset : ref.offset + ref.nbytes]

    def raw(self, offset: int, nbytes: int) -> memoryview:
        if offset < 0 or nbytes < 0 or offset + nbytes > self.size:
            raise ArenaError(f"[{offset}, {offset + nbytes}) outside arena of {self.size}")
        return self._mv[offset : offset + nbytes]

    def close(self) -> None:
        if self._owner:
            _unlink_quietly(os.path.join(SHM_DIR, self.name))
        try:
            self._mv.release()
            self._mm.close()
        except BufferError:
            # A tensor still views the mapping; the OS frees it with the process.
            pass


def _pid_namespace() -> int:
    """This process's PID namespace (its inode), 0 if unknown."""
    try:
        return int(os.readlink("/proc/self/ns/pid").split("[")[1].rstrip("]"))
    except (OSError, IndexError, ValueError):
        return 0


# A pid means something only inside its PID namespace: containers that share /dev/shm (one IPC
# namespace) but not their PIDs, e.g. vLLM and the sidecar in deploy/docker-compose*.yml, would
# each take the other's live creators for dead. Names carry both; only our namespace's are swept.
PID_NAMESPACE = _pid_namespace()
_STALE_RE = re.compile(r"^omni-[A-Za-z0-9.-]*?-n(\d+)-(\d+)-[0-9a-f]{12}$")


def sweep_stale(shm_dir: str = SHM_DIR) -> list[str]:
    """Remove our arenas whose creator died before the peer mapped them.

    Names carry the creator's PID namespace and pid; the peer unlinks a name once mapped, so what
    is left with a dead creator of our namespace is garbage (e.g. a reconnect attempt pending
    when vLLM exited). Only files of our own uid are touched.
    """
    removed = []
    try:
        names = os.listdir(shm_dir)
    except OSError:
        return removed
    for name in names:
        m = _STALE_RE.match(name)
        if m is None or int(m.group(1)) != PID_NAMESPACE:
            continue
        path = os.path.join(shm_dir, name)
        try:
            if os.stat(path).st_uid != os.getuid():
                continue
            os.kill(int(m.group(2)), 0)
        except ProcessLookupError:
            _unlink_quietly(path)
            removed.append(name)
        except OSError:
            continue  # alive under another uid (EPERM), or gone meanwhile
    return removed


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


class SlotRing:
    """Splits an arena into equal slots written round-robin, one per step.

    The writer may reuse slot s only after the reader acknowledged the step
    that last used it; `owner_step` remembers which step that was.
    """

    def __init__(self, arena_size: int, num_slots: int) -> None:
        if num_slots < 1:
            raise ArenaError("need at least one slot")
        self.num_slots = num_slots
        self.slot_size = arena_size // num_slots // ALIGN * ALIGN
        self.owner_step: list[int | None] = [None] * num_slots

    def slot_of(self, step: int) -> int:
        return step % self.num_slots

    def offset(self, slot: int) -> int:
        return slot * self.slot_size
