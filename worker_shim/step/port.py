"""The sidecar as a step sees it: the few operations a step needs, typed.

Two implementations: the connection to a sidecar process (worker_shim/wire/connection.py: ring or
socket, arenas) and the in-process baseline (bench/inproc.py: the hooks called in this process,
tensors by reference). Replies are read where they arrive, the port's `channel` (`ReplyChannel`).
`RecoveryPort` adds what `Recovery` needs to replace a lost or handed-over sidecar.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol

import torch

from proto.messages import (HookNeeds, Message, MirrorUpdate, StepBegin, StepEnd, StepPlan, StepResult, StepTick, SwitchAck,
                            Welcome)

ModelStates = dict[str, Any]  # per request: its state, as the model's own hooks keep it


class StepSlot(Protocol):
    """Where a step's tensors go for its StepEnd: hidden rows first, then the model's results."""

    def put(self, tensor: torch.Tensor, steady: bool = False) -> Any: ...

    def put_stack(self, rows: list[torch.Tensor]) -> Any: ...

    def put_hidden(self, hidden: torch.Tensor, layers: dict[int, torch.Tensor] | None) -> tuple[Any, dict[int, Any]]: ...

    def seal(self) -> int: ...

    def sent(self) -> None: ...


class ReplyChannel(Protocol):
    """What the sidecar sent, as a step reads it: results, mirror updates, the answers owed to
    StepStarts, a hand-over (done or asked for), the peer gone."""

    switch_ack: SwitchAck | None  # the old sidecar handed this session over while idle (else None)
    switch_to: str  # a result asked to switch to this sidecar at the next step boundary ("": none)
    pongs_due: int  # StepStarts of this step whose answer has not come yet
    mirror_updates: list[MirrorUpdate]  # received, not yet taken (the port's `take_mirror_updates`)

    def await_pongs(self) -> None:
        """Wait for the StepStarts' answers; SidecarError, `switch_ack` set, when handed over first."""

    def take_results(self, until_step: int | None = None) -> list[StepResult]:
        """Results received so far; blocks (up to the step timeout) for `until_step`'s."""

    def poll_ring_results(self) -> list[StepResult]:
        """Results already there, without waiting (a StepResult with `switch_to` answers a StepTick)."""

    def peer_gone(self) -> bool: ...


class SidecarPort(Protocol):
    """What one step asks of the sidecar serving it."""

    channel: ReplyChannel
    needs: HookNeeds
    hook_set: str
    peer_req_ids: list[str] | None  # the request order the sidecar holds (a layout omits it when unchanged)
    step_open: bool  # a StepStart went out, its StepEnd not yet
    last_sent_step: int  # the last step ended (StepEnd or StepTick)
    last_answered_step: int  # the last StepEnd (the last step a StepResult answers)

    @property
    def sends_hidden(self) -> bool:
        """The sidecar takes hidden states and this port has slots for them."""

    def step_plan(self, msg: StepBegin) -> StepPlan: ...

    def ask_plan(self, msg: StepBegin) -> None: ...

    def take_plan(self, msg: StepBegin) -> StepPlan: ...

    def read_plan(self, plan: StepPlan, input_batch: Any, model: Any, embeds: torch.Tensor | None) -> dict[str, Any]: ...

    def read_states(self, plan: StepPlan) -> ModelStates: ...

    def announce_step(self, step: int, answer_after_s: float) -> None: ...

    def claim_slot(self, step: int, wait_answered: Callable[[int], None]) -> StepSlot: ...

    def send(self, msg: StepEnd | StepTick) -> None: ...

    def take_mirror_updates(self) -> list[tuple[str, dict[str, Any]]]: ...

    def sync(self) -> None: ...


class RecoveryPort(SidecarPort, Protocol):
    """The port as `Recovery` holds it: hand-over and reconnect."""

    endpoint: str
    step_timeout_s: float
    started: float
    welcome: Welcome | None
    mirror_seq: int

    def call(self, msg: Message, want: type) -> Any: ...

    def connect(self, timeout_s: float) -> Welcome: ...

    def start(self) -> None: ...

    def poll(self, wait_ms: int = 0) -> bool: ...

    def stats(self) -> dict[str, Any]: ...

    def close(self) -> None: ...


Connect = Callable[..., RecoveryPort]  # (endpoint=..., resume_token=...) -> a fresh, unconnected port
