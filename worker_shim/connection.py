"""One connection to one sidecar: socket, arenas, and what the sidecar said it needs.

A new connection (start-up, or reconnect after the sidecar died or was
replaced) gets a new hidden-state arena: the previous sidecar removed the old
one's name once it had mapped it.
"""

from __future__ import annotations

import time
from typing import Any

import msgspec

from proto.arena import ArenaError, ShmArena, SlotRing
from proto.messages import ArenaInfo, Hello, HookNeeds, Welcome
from worker_shim.channel import SidecarChannel, SidecarError


class SidecarConnection:
    def __init__(self, endpoint: str, step_timeout_s: float, hello: Hello, hidden_bytes: int,
                 hidden_slots: int, arena_prefix: str, curve_keys: str | None = None,
                 device: Any = None, arena_kind: str = "shm", ring: Any = None) -> None:
        self.arena_kind = arena_kind
        self.device = device
        self.opens = None  # CUDA IPC: OpenCounts of the peer's buffer / events
        self.hidden_arena: Any = None
        self._out_done: list[Any] = []  # our done events for the sidecar's arena (CUDA IPC)
        if arena_kind == "cuda_ipc":
            from omni_arena.cuda_ipc import CudaIpcArena, OpenCounts, event_handles, new_event

            self.opens = OpenCounts()
            self.hidden_arena = CudaIpcArena.create(hidden_bytes, device, hidden_slots, name=arena_prefix)
            self._out_done = [new_event(device)]
            hello = msgspec.structs.replace(hello, consumer_events=event_handles(self._out_done))
        else:
            self.hidden_arena = ShmArena.create(hidden_bytes, prefix=arena_prefix)
        self.hello = msgspec.structs.replace(hello, arenas=[self.hidden_arena.info()])
        self.channel = SidecarChannel(endpoint, step_timeout_s, curve_keys, ring=ring)
        self.hidden_slots = hidden_slots
        self.started = time.monotonic()
        self.welcome: Welcome | None = None
        self.needs = HookNeeds()
        self.hook_set = ""
        self.ring: SlotRing | None = None
        self.overlay_arena: Any = None

    def connect(self, timeout_s: float) -> Welcome:
        """Start-up: wait for the Welcome, or fail with a message that says what to do."""
        try:
            self._accept(self.channel.handshake(self.hello, timeout_s))
        except BaseException:
            self.close()
            raise
        assert self.welcome is not None
        return self.welcome

    def start(self) -> None:
        """Reconnect: send Hello now; `poll` picks up the Welcome on a later step."""
        self.channel.send(self.hello)

    def poll(self, wait_ms: int = 0) -> bool:
        welcome = self.channel.poll_welcome(self.hello, wait_ms)
        if welcome is None:
            return False
        self._accept(welcome)
        return True

    def _accept(self, welcome: Welcome) -> None:
        self.welcome = welcome
        self.needs = welcome.needs
        self.hook_set = welcome.hook_set
        if welcome.arenas:
            self.overlay_arena = self._attach(welcome.arenas[0])
        if welcome.needs.hidden_states:
            assert self.hidden_arena is not None
            self.ring = SlotRing(self.hidden_arena.size, self.hidden_slots)
            if self.opens is not None:
                self.hidden_arena.open_peer_done(list(welcome.consumer_events), self.opens)
        elif self.hidden_arena is not None:
            self.hidden_arena.close()
            self.hidden_arena = None

    def _attach(self, info: ArenaInfo) -> Any:
        """Open the sidecar's arena once; CUDA IPC only when we offered it (same kinds both ways)."""
        if info.kind != self.arena_kind:
            raise SidecarError(f"sidecar offered a {info.kind!r} arena; this shim uses {self.arena_kind!r}")
        try:
            if info.kind == "cuda_ipc":
                from omni_arena.cuda_ipc import CudaIpcArena

                arena = CudaIpcArena.attach(info, self.opens)
                arena.done = self._out_done
                return arena
            return ShmArena.attach(info)
        except ArenaError as exc:
            raise SidecarError(f"cannot open the sidecar's arena: {exc}") from None

    def open_counts(self) -> dict[str, int]:
        return {"mem": self.opens.mem, "events": self.opens.events} if self.opens is not None else {}

    def close(self) -> None:
        self.channel.close()
        for arena in (self.hidden_arena, self.overlay_arena):
            if arena is not None:
                arena.close()
        self.hidden_arena = self.overlay_arena = None


__all__ = ["SidecarConnection", "SidecarError"]
