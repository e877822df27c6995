"""One connection to one sidecar: its channel, its arenas, and what the sidecar has seen.

The shim's `SidecarPort` (worker_shim/step/port.py) over a sidecar process: messages through
the channel (socket and shared-memory rings; a step reads the replies there), tensors through
the arenas. A new connection (start-up, or reconnect after the sidecar died or was replaced)
gets a new hidden-state arena: the previous sidecar removed the old one's name once it had
mapped it.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import msgspec
import torch

from proto.arena import ArenaError, ShmArena
from proto.messages import (
    ArenaInfo, ArenaKind, Hello, HookNeeds, Message, Ping, Pong, StepBegin, StepEnd, StepPlan, StepStart, StepTick,
    Welcome,
)
from omni_arena.tensor_tree import decode_inline
from proto.plan_trees import TreeError
from worker_shim.wire.channel import SidecarChannel, SidecarError
from worker_shim.config import RingConfig
from worker_shim.step.plan_read import PlanLanding, read_plan, read_states
from worker_shim.step.protocol import step_start
from worker_shim.step.slots import HiddenSlots, StepSlot


class SidecarConnection:
    def __init__(self, endpoint: str, step_timeout_s: float, hello: Hello, hidden_bytes: int,
                 hidden_slots: int, arena_prefix: str, curve_keys: str | None = None,
                 device: Any = None, arena_kind: ArenaKind = "shm", ring: RingConfig | None = None) -> None:
        self.arena_kind = arena_kind
        self.opens = None  # CUDA IPC: OpenCounts of the peer's buffer / events
        self._hidden_arena: Any = None
        self._out_done: list[Any] = []  # our done events for the sidecar's arena (CUDA IPC)
        if arena_kind == "cuda_ipc":
            from omni_arena.cuda_ipc import CudaIpcArena, OpenCounts, event_handles, new_event

            self.opens = OpenCounts()
            self._hidden_arena = CudaIpcArena.create(hidden_bytes, device, hidden_slots, name=arena_prefix)
            self._out_done = [new_event(device)]
            hello = msgspec.structs.replace(hello, consumer_events=event_handles(self._out_done))
        else:
            self._hidden_arena = ShmArena.create(hidden_bytes, prefix=arena_prefix)
        self.hello = msgspec.structs.replace(hello, arenas=[self._hidden_arena.info()])
        self.channel = SidecarChannel(endpoint, step_timeout_s, curve_keys, ring=ring)
        self.endpoint = endpoint
        self.step_timeout_s = step_timeout_s
        self._num_hidden_slots = hidden_slots
        self._hidden: HiddenSlots | None = None
        self._overlay_arena: Any = None
        self._landing = PlanLanding()  # where this sidecar's plans' kwargs land (worker_shim/step/plan_read.py)
        self.started = time.monotonic()
        self.welcome: Welcome | None = None
        self.needs = HookNeeds()
        self.hook_set = ""
        # What this sidecar has seen: the last step ended (StepEnd or StepTick), the last StepEnd
        # (the last step a StepResult answers) and the request order it holds.
        self.last_sent_step = -1
        self.last_answered_step = -1
        self.peer_req_ids: list[str] | None = None
        self.last_sent_at = self.started  # taken before each send: never later than the sidecar read it
        self.step_open = False  # a StepStart went out, its StepEnd not yet: the sidecar counts us as stepping
        self.mirror_seq = 0  # the last MirrorUpdate applied (told in StepStart / SwitchReady)

    # -- handshake ------------------------------------------------------------------

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
            self._overlay_arena = self._attach(welcome.arenas[0])
        if welcome.needs.hidden_states or welcome.needs.model_states:  # captured layers ride in the same slots
            assert self._hidden_arena is not None
            self._hidden = HiddenSlots(self._hidden_arena, self._num_hidden_slots)
            if self.opens is not None:
                self._hidden_arena.open_peer_done(list(welcome.consumer_events), self.opens)
        elif self._hidden_arena is not None:
            self._hidden_arena.close()
            self._hidden_arena = None

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

    # -- messages -------------------------------------------------------------------

    def send(self, msg: Message) -> None:
        if type(msg) is StepTick:  # the one message of a pass-through step: none of the type tests below
            self.last_sent_at = time.monotonic()
            self.channel.send_quiet(msg)
            self.step_open = False
            self.last_sent_step = msg.step
            return
        sent_at = time.monotonic()
        self.channel.send(msg)
        self._note_sent(msg, sent_at)

    def sync(self) -> None:
        """One round trip behind everything sent so far (a Ping: one order per connection): the
        sidecar has read it all, StepTicks included."""
        self.call(Ping(nonce=-1), Pong)  # -1: never a step, so never taken for a StepStart's answer

    def call(self, msg: Message, want: type) -> Any:
        self._note_sent(msg, time.monotonic())  # a step message's layout is the sidecar's even when no reply comes
        return self.channel.call(msg, want)

    def announce_step(self, step: int, answer_after_s: float) -> None:
        """StepStart, first thing in a step: the sidecar hands a session over on its own only between
        steps. After `answer_after_s` without sending, it may be doing so right now: the StepStart
        asks for an answer (worker_shim/step/protocol.py), awaited at the step's one wait (the plan's
        round trip, else the channel's `await_pongs`). See docs/ARCHITECTURE.md, Hot upgrade."""
        quiet_since = self.last_sent_at
        self.step_open = True
        now = time.monotonic()
        if step_start(now - quiet_since, answer_after_s).wait is None:
            # A StepStart that wants no answer wakes nobody: one ring write (no routing or type tests).
            self.channel.send_quiet(StepStart(step=step, mirror_seq=self.mirror_seq))
            self.last_sent_at = now
            if step_start(time.monotonic() - quiet_since, answer_after_s).wait is None:
                return  # written while the sidecar still counted this session as stepping
        self.send(StepStart(step=step, answer=True, mirror_seq=self.mirror_seq))
        self.channel.pongs_due += 1

    def take_mirror_updates(self) -> list[tuple[str, dict[str, Any]]]:
        """(req_id, entries) of the MirrorUpdates received so far (read with `channel.take_results`), in order,
        now counted as applied: the caller applies them before this step's StepStart
        (docs/ARCHITECTURE.md, Streaming payloads)."""
        updates, self.channel.mirror_updates = self.channel.mirror_updates, []
        out = []
        for update in updates:
            try:
                out.append((update.req_id, decode_inline(update.entries, update.blobs)))
            except TreeError as exc:
                raise SidecarError(f"bad MirrorUpdate {update.seq}: {exc}") from None
            self.mirror_seq = update.seq
        return out

    def step_plan(self, msg: StepBegin) -> StepPlan:
        return _plan_of(msg, self.call(msg, StepPlan))

    def ask_plan(self, msg: StepBegin) -> None:
        """The StepBegin now, its plan taken later by `take_plan` (nothing else is sent between)."""
        self._note_sent(msg, time.monotonic())
        self.channel.send(msg)

    def take_plan(self, msg: StepBegin) -> StepPlan:
        return _plan_of(msg, self.channel.answer(msg, StepPlan))

    def _note_sent(self, msg: Message, sent_at: float) -> None:
        if isinstance(msg, (StepStart, StepBegin, StepEnd)):  # what the sidecar counts as stepping
            self.last_sent_at = sent_at
        if isinstance(msg, StepEnd):
            self.step_open = False
        if isinstance(msg, (StepBegin, StepEnd)):  # both carry a layout
            layout = msg.batch
            if layout is not None and layout.req_ids is not None:
                self.peer_req_ids = layout.req_ids
        if isinstance(msg, StepEnd):
            self.last_sent_step = self.last_answered_step = msg.step

    # -- tensors --------------------------------------------------------------------

    @property
    def sends_hidden(self) -> bool:
        return self._hidden is not None and self.needs.hidden_states

    def claim_slot(self, step: int, wait_answered: Callable[[int], None]) -> StepSlot:
        """`step`'s hidden slot (hidden rows, then model updates and outputs)."""
        assert self._hidden is not None
        return self._hidden.claim(step, wait_answered)

    def read_states(self, plan: StepPlan) -> dict[str, Any]:
        return read_states(self._overlay_arena, plan)

    def read_plan(self, plan: StepPlan, input_batch: Any, model: Any, embeds: torch.Tensor | None) -> dict[str, Any]:
        return read_plan(self._overlay_arena, plan, input_batch, model, embeds, self._landing)

    def stats(self) -> dict[str, Any]:
        """The arena kind, CUDA IPC opens, and the rings' kicks sent to a sleeping sidecar and our own
        sleeps waiting for one (each a step's kernel round trip on the critical path)."""
        channel, opens = self.channel, self.opens
        return {
            "arena_kind": self.arena_kind,
            "arena_opens": {"mem": opens.mem, "events": opens.events} if opens is not None else {},
            "ring_counts": {"kicks": channel.kicks_sent, "sleeps": channel.sleeps} if channel.rings is not None else {},
        }

    def close(self) -> None:
        self.channel.close()
        self._hidden = None  # first: its slot views keep the mapping exported
        self._landing.close()
        for arena in (self._hidden_arena, self._overlay_arena):
            if arena is not None:
                arena.close()
        self._hidden_arena = self._overlay_arena = None


def _plan_of(msg: StepBegin, plan: StepPlan) -> StepPlan:
    """The plan, if it answers `msg`'s step: one for another step (a StepBegin sent twice, a plan left
    unread) would put another batch's kwargs on this one's rows."""
    if plan.step != msg.step:
        raise SidecarError(f"the sidecar answered step {msg.step} with the plan of step {plan.step}")
    return plan


__all__ = ["SidecarConnection", "SidecarError"]
