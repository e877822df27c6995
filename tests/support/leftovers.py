"""What a test session leaves behind: live processes it started, /dev/shm files it created and
Unix socket files it left in the temporary directory.

Ours are the descendants of the pytest process (under pytest-xdist, the controller: its workers
and what they start are its descendants), every process carrying the session's marker
in its environment (children inherit it), and processes started during the session by our
uid that are in pytest's process group or, re-parented to init, name themselves like ours
(VLLM::EngineCore / VLLM::Worker rewrite their title over the environment, so the marker is
gone there; the process group and the name still tell). A process that is not a descendant and
carries another session's marker (a test's own inner session, while the other worker starts
processes in the same group) is that session's. Shared-memory files count when
they appeared during the session, still exist, and are not held by another session's
processes (a background sampler notes who maps or opens each new file while the suite runs).
Socket files count when they appeared in this process's temporary directory during the session and
remain (what the suite starts, and vLLM's sockets, go to a directory of the session's own instead,
removed at its end: tests/conftest.py).
"""

from __future__ import annotations

import os
import secrets
import stat
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

MARKER = "OMNI_TEST_SESSION"
SHM_DIR = Path("/dev/shm")
SHM_PREFIXES = ("psm_", "omni-", "omni_")
SAMPLE_S = 0.5
OUR_NAMES = ("VLLM::", "omni-sidecar", "omni_sidecar", "multiprocessing.resource_tracker", "engine_job.py",
             "engine_forks.py")


def _read(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:
        return b""


def _pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def _stat(pid: int) -> tuple[str, int, int] | None:
    """(state, parent pid, process group) from /proc/<pid>/stat; None once the process is gone."""
    raw = _read(f"/proc/{pid}/stat").decode(errors="replace")
    if not raw:
        return None
    fields = raw[raw.rfind(")") + 2:].split()
    return fields[0], int(fields[1]), int(fields[2])


def _uid(pid: int) -> int:
    try:
        return os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return -1


def _cmdline(pid: int) -> str:
    return _read(f"/proc/{pid}/cmdline").replace(b"\0", b" ").decode(errors="replace").strip()


def _shm_held(pid: int) -> set[str]:
    """Names of /dev/shm files the process maps or has open."""
    names = set()
    for line in _read(f"/proc/{pid}/maps").decode(errors="replace").splitlines():
        idx = line.find("/dev/shm/")
        if idx >= 0:
            names.add(line[idx + len("/dev/shm/"):].split(" ")[0])
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            if target.startswith("/dev/shm/"):
                names.add(target[len("/dev/shm/"):].removesuffix(" (deleted)"))
    except OSError:
        pass
    return names


def _sockets(directory: Path) -> set[str]:
    """Unix socket files directly in `directory`."""
    out = set()
    try:
        for entry in os.scandir(directory):
            try:
                if stat.S_ISSOCK(entry.stat(follow_symlinks=False).st_mode):
                    out.add(entry.name)
            except OSError:
                pass
    except OSError:
        pass
    return out


def _shm_files(prefixes: tuple[str, ...]) -> set[str]:
    try:
        return {p.name for p in SHM_DIR.iterdir() if p.name.startswith(prefixes)}
    except OSError:
        return set()


@dataclass
class LeftoverCheck:
    root_pid: int = field(default_factory=os.getpid)
    token: str = field(default_factory=lambda: f"{os.getpid()}-{secrets.token_hex(4)}")
    pids_at_start: set[int] = field(default_factory=set)
    shm_at_start: set[str] = field(default_factory=set)
    shm_ours: set[str] = field(default_factory=set)
    shm_foreign: set[str] = field(default_factory=set)
    tmp_dir: Path = field(default_factory=lambda: Path(tempfile.gettempdir()))
    # What counts as the suite's: /dev/shm names, and the names of processes re-parented to init. The
    # leftover check's own test narrows both for its inner sessions, which run while the outer
    # session's other worker starts engines and arenas.
    shm_prefixes: tuple[str, ...] = SHM_PREFIXES
    orphan_names: tuple[str, ...] = OUR_NAMES
    sockets_at_start: set[str] = field(default_factory=set)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> None:
        os.environ[MARKER] = self.token
        self.pids_at_start = set(_pids())
        self.shm_at_start = _shm_files(self.shm_prefixes)
        self.sockets_at_start = _sockets(self.tmp_dir)
        self._thread = threading.Thread(target=self._sample_loop, name="leftover-sampler", daemon=True)
        self._thread.start()

    def _is_ours(self, pid: int, procs: dict[int, tuple[int, int]]) -> bool:
        ancestor = procs.get(pid, (None,))[0]
        while ancestor is not None and ancestor > 1:
            if ancestor == self.root_pid:
                return True
            ancestor = procs.get(ancestor, (None,))[0]
        env = _read(f"/proc/{pid}/environ").split(b"\0")
        marker = next((v for v in env if v.startswith(f"{MARKER}=".encode())), None)
        if marker is not None:  # a session's mark: ours, or another session's (a test's inner session)
            return marker == f"{MARKER}={self.token}".encode()
        if pid in self.pids_at_start or _uid(pid) != os.getuid():
            return False
        parent, group = procs[pid]
        return group == os.getpgid(self.root_pid) or (
            parent == 1 and any(name in _cmdline(pid) for name in self.orphan_names))

    def _processes(self) -> dict[int, tuple[int, int]]:
        """Live (not zombie) processes: pid -> (parent pid, process group)."""
        out = {}
        for pid in _pids():
            st = _stat(pid)
            if st is not None and st[0] != "Z":
                out[pid] = (st[1], st[2])
        return out

    def ours(self) -> list[int]:
        procs = self._processes()
        return sorted(pid for pid in procs if pid != self.root_pid and self._is_ours(pid, procs)
                      and not self._dies_with_us(pid, procs))

    def _dies_with_us(self, pid: int, procs: dict[int, tuple[int, int]]) -> bool:
        """Our own resource tracker: it exits when pytest does (it reads a pipe we hold)."""
        return procs[pid][0] == self.root_pid and "multiprocessing.resource_tracker" in _cmdline(pid)

    def _sample(self) -> None:
        new = _shm_files(self.shm_prefixes) - self.shm_at_start - self.shm_ours - self.shm_foreign
        if not new:
            return
        procs = self._processes()
        for pid in procs:
            held = _shm_held(pid) & new
            if held:
                mine = pid == self.root_pid or self._is_ours(pid, procs)
                (self.shm_ours if mine else self.shm_foreign).update(held)

    def _sample_loop(self) -> None:
        while not self._stop.wait(SAMPLE_S):
            self._sample()

    def finish(self, grace_s: float = 15.0) -> str:
        """'' when nothing is left; otherwise what is, one item a line."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
        self._sample()
        deadline = time.monotonic() + grace_s
        while (alive := self.ours()) and time.monotonic() < deadline:
            time.sleep(0.2)  # a sidecar draining, an engine finishing its shutdown
        left_shm = sorted((_shm_files(self.shm_prefixes) - self.shm_at_start) - self.shm_foreign)
        lines = [f"  process {pid}: {_cmdline(pid)[:200]}" for pid in alive]
        lines += [f"  /dev/shm/{name}" for name in left_shm]
        lines += [f"  socket {self.tmp_dir / name}" for name in sorted(_sockets(self.tmp_dir) - self.sockets_at_start)]
        return "\n".join(lines)
