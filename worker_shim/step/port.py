"""The sidecar as a step sees it: the few operations a step needs, typed.

Two implementations: the connection to a sidecar process (worker_shim/wire/connection.py: ring or
socket, arenas) and the in-process baseline (bench/inproc.py: the hooks called in this process,
tensors by reference). `RecoveryPort` adds what `Recovery` needs to tell a lost or handed-over
sidecar from a live one and to replace it.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol

import torch

from proto.messages import HookNeeds, Message, StepBegin, StepEnd, StepPlan, StepResult, StepTick, SwitchAck, Welcome

ModelStates = dict[str, Any]  # per request: its state, as the model's own hooks keep it


class StepSlot(Protocol):
    """Where a step's tensors go for its StepEnd: hidden rows first, then the model's results."""

    def put(self, tensor: torch.Tensor, steady: bool = False) -> Any: ...

    def put_hidden(self, hidden: torch.Tensor, layers: dict[int, torch.Tensor] | None) -> tuple[Any, dict[int, Any]]: ...

    def seal(self) -> int: ...

    def sent(self) -> None: ...


class SidecarPort(Protocol):
    """What one step asks of the sidecar serving it."""

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

    def claim_slot(self, step: int, wait_answered: Callable[[int], None]) -> StepSlot: ...

    def send(self, msg: StepEnd | StepTick) -> None: ...

    def take_results(self, until_step: int | None = None) -> list[StepResult]: ...

    def poll_results(self) -> list[StepResult]: ...

    def take_mirror_updates(self) -> list[tuple[str, dict[str, Any]]]: ...

    @property
    def mirror_updates_waiting(self) -> int: ...

    def sync(self) -> None: ...


class RecoveryPort(SidecarPort, Protocol):
    """The port as `Recovery` holds it: liveness, hand-over and reconnect."""

    endpoint: str
    step_timeout_s: float
    started: float
    welcome: Welcome | None
    mirror_seq: int

    def announce_step(self, step: int, answer_after_s: float) -> None: ...

    @property
    def answer_due(self) -> bool: ...

    def await_answer(self) -> None: ...

    @property
    def switch_ack(self) -> SwitchAck | None: ...

    def peer_gone(self) -> bool: ...

    def call(self, msg: Message, want: type) -> Any: ...

    def connect(self, timeout_s: float) -> Welcome: ...

    def start(self) -> None: ...

    def poll(self, wait_ms: int = 0) -> bool: ...

    def stats(self) -> dict[str, Any]: ...

    def close(self) -> None: ...


Connect = Callable[..., RecoveryPort]  # (endpoint=..., resume_token=...) -> a fresh, unconnected port
