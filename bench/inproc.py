"""The in-process baseline: the sidecar's own session and hooks, called directly in the vLLM worker.

What does the process boundary cost: the same hook set run through the sidecar versus run in
the worker itself, as vllm-omni runs its hooks. This module is that baseline's port: it
implements the shim's `RecoveryPort` (worker_shim/step/port.py), as `SidecarConnection` does,
so the shim's unchanged `SidecarLink` drives it, but every message goes straight into an
`omni_sidecar.sessions.session.Session` in this process:

- no encode, no socket, no ring, no kick, no wait: `step_plan(StepBegin)` is the call
  `Session.step_begin`, `send(StepEnd)` is `Session.step_end`, `send(StepTick)` is `step_tick`;
  a plan's trees ride as the trees themselves where their bytes would (`encode_tree`);
- no arena copies: where the shim would copy a tensor into an arena and send its ref, a
  `HeldRef` carries the tensor itself (hidden rows and captured layers are views of vLLM's
  buffers, valid while the hooks run, which is synchronous here); `InProcessArenas` hands
  them to the session as its `SessionArenas` would hand out arena views. Hooks copy what they
  keep, as they must anyway (omni_sidecar/hook_api/hook_set.py: "copy to keep").
- what is left is what the hooks themselves need: the batch layout they read (the packed
  `BatchLayout` the shim builds, read as the sidecar reads it), the message structs the session takes (built, never encoded),
  overlay rows copied into the embeds buffer, extra-kwargs tensors on the model's device (the
  form the model gets them in through the shim), and the hooks' own work, which here runs on
  the worker's thread (through the sidecar, `process_model_output` runs in another process,
  overlapping the next step: the boundary can also pay for itself).

So the same hook code, the same admission / replay / finish / output-store logic run; the
plan the model sees and the outputs clients read are the same (tests/test_inproc_baseline.py).
Not covered: hot upgrade, reconnects, appends from clients (no client can reach these hooks)
and tensor parallelism.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import torch

from omni_sidecar.hook_api.hook_set import OmniHooks, wire_needs
from omni_sidecar.sessions.session import Session
from omni_sidecar.sessions.store import FinishedOutputs
from omni_arena.tensor_tree import TreeDecoder
from proto.messages import (
    Hello, Message, MirrorUpdate, Overlay, StepBegin, StepEnd, StepPlan, StepResult, StepTick, Welcome,
)
from proto.version import PROTOCOL_MAJOR, PROTOCOL_MINOR
from worker_shim.errors import SidecarError
from worker_shim.step.plan_read import model_device


class HeldRef:
    """A tensor where a `TensorRef` would be: the tensor itself, no arena. `nbytes` for the
    session's metrics; truthy like a ref."""

    __slots__ = ("tensor",)

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()


class HeldSlot:
    """A step's "hidden slot" without memory of its own: `put` hands out the tensor itself."""

    def put(self, tensor: torch.Tensor, steady: bool = False) -> HeldRef:
        return HeldRef(tensor.detach())

    def put_stack(self, rows: list[torch.Tensor]) -> HeldRef:
        return HeldRef(torch.stack([r.detach() for r in rows]))

    def put_layers(self, layers: dict[int, torch.Tensor] | None) -> dict[int, HeldRef]:
        return {n: self.put(rows) for n, rows in (layers or {}).items()}

    def put_hidden(self, hidden: torch.Tensor, layers: dict[int, torch.Tensor] | None
                   ) -> tuple[HeldRef, dict[int, HeldRef]]:
        return self.put(hidden), self.put_layers(layers)

    def seal(self) -> int:
        return -1  # no ready event: one thread, one stream

    def sent(self) -> None:
        pass  # no slot to hold until the step's result


def _map_tensors(value: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """`fn` on every tensor of a tree of dicts and lists (tuples become lists, as msgpack makes them)."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, dict):
        return {k: _map_tensors(v, fn) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_map_tensors(v, fn) for v in value]
    return value


class NoMetrics:
    """`SidecarMetrics` that records nothing: Prometheus series exist for a daemon that serves
    scrapes, not for hooks called in the worker (each observe costs µs a step). Any metric, any
    labels, any update: a no-op."""

    def __getattr__(self, name: str) -> "NoMetrics":
        return self

    def __call__(self, *args: Any, **kwargs: Any) -> "NoMetrics":
        return self


class InProcessArenas:
    """The session's tensor moves (`SessionArenas`' interface) with no arena: tensors pass by reference."""

    out = None  # no out-arena: Session.step_begin skips reset/seal
    opens = None
    stacks: list = []  # tensors pass by reference: nothing is stacked
    stacked_rows = 0
    consumer_events: list[bytes] = []

    def __init__(self, wanted_layers: list[int]) -> None:
        self.wanted_layers = wanted_layers

    def hidden(self, msg: StepEnd) -> torch.Tensor | None:
        return None if msg.hidden is None else msg.hidden.tensor

    def hidden_layers(self, msg: StepEnd) -> dict[int, torch.Tensor]:
        return {n: ref.tensor for n, ref in msg.hidden_layers.items() if n in self.wanted_layers}

    def model_results(self, msg: StepEnd) -> tuple[dict[str, Any], dict[str, Any]]:
        # The shim's trees, their tensors held (HeldSlot): each a copy, as the hook API promises
        # ("Tensors are copies"), the model's hooks keep theirs.
        held = msg.tensors
        decoder = TreeDecoder(len(held), lambda k: held[k].tensor, own=True,  # type: ignore[attr-defined]
                              copy_budget=sum(ref.nbytes for ref in held))
        return decoder.decode(msg.model_updates, dict[str, Any]), decoder.decode(msg.model_outputs, dict[str, Any])

    def release_slot(self, msg: StepEnd) -> None:
        pass

    def write_overlays(self, pairs: list[tuple[int, torch.Tensor]]) -> list[Overlay]:
        return [Overlay(row_start, rows) for row_start, rows in pairs]  # type: ignore[arg-type]

    def encode_tree(self, value: Any) -> Any:
        """The tree itself where its bytes would ride (the plan is handed over, never encoded):
        its tensors by reference."""
        return value

    def close(self) -> None:
        pass


class InProcessReplies:
    """The port's `ReplyChannel` (worker_shim/step/port.py): each StepEnd's result, kept from its
    "send" until the link takes it; nothing can hand the session over or go away."""

    switch_ack = None
    switch_to = ""
    pongs_due = 0

    def __init__(self) -> None:
        self.results: list[StepResult] = []
        self.mirror_updates: list[MirrorUpdate] = []  # none: no client can append to these requests

    def await_pongs(self) -> None:
        pass  # never due

    def take_results(self, until_step: int | None = None) -> list[StepResult]:
        results, self.results = self.results, []
        return results

    def poll_ring_results(self) -> list[StepResult]:
        return self.take_results()

    def peer_gone(self) -> bool:
        return False


class InProcessConnection:
    """The shim's `RecoveryPort` (worker_shim/step/port.py) over a Session in this process (see the
    module doc)."""

    step_open = False
    mirror_seq = 0
    endpoint = "inproc://"
    step_timeout_s = 10.0

    def __init__(self, hello: Hello, hooks: OmniHooks, finished: FinishedOutputs) -> None:
        self.hello = hello
        self.hooks = hooks
        self.finished = finished
        self.needs = wire_needs(hooks)
        self.hook_set = hooks.name
        self.session = Session(1, hello, hooks, finished, NoMetrics())  # type: ignore[arg-type]
        self.session.arenas = InProcessArenas(list(self.needs.hidden_layers))  # type: ignore[assignment]
        self.welcome = Welcome(protocol_major=PROTOCOL_MAJOR, protocol_minor=PROTOCOL_MINOR,
                               sidecar_version="inproc", hook_set=hooks.name, needs=self.needs, session=1)
        self.started = self.last_sent_at = time.monotonic()
        self.last_sent_step = -1
        self.last_answered_step = -1
        self.peer_req_ids: list[str] | None = None
        self.channel = InProcessReplies()

    # -- the handshake: already done ------------------------------------------------

    def connect(self, timeout_s: float = 0.0) -> Welcome:
        return self.welcome

    def start(self) -> None:
        pass

    def poll(self, wait_ms: int = 0) -> bool:
        return True

    # -- step messages: calls into the session -------------------------------------

    def announce_step(self, step: int, answer_after_s: float) -> None:
        """StepStart tells a sidecar in another process that a step is in flight (hot upgrade);
        here nothing can hand the session over."""

    def step_plan(self, msg: StepBegin) -> StepPlan:
        self._note_layout(msg)
        return self.session.step_begin(msg)

    def ask_plan(self, msg: StepBegin) -> None:
        """The early StepBegin: nothing to overlap in one thread, so the session plans when it is taken."""

    def take_plan(self, msg: StepBegin) -> StepPlan:
        return self.step_plan(msg)

    def send(self, msg: Message) -> None:
        if isinstance(msg, StepTick):
            self.last_sent_step = msg.step
            self.session.step_tick(msg)
            return
        if not isinstance(msg, StepEnd):
            raise SidecarError(f"the in-process baseline has no answer to {type(msg).__name__}")
        self._note_layout(msg)
        self.last_sent_step = self.last_answered_step = msg.step
        self.channel.results.append(self.session.step_end(msg))

    def call(self, msg: Message, want: type) -> Message:
        raise SidecarError(f"the in-process baseline has no answer to {type(msg).__name__}")

    def _note_layout(self, msg: StepBegin | StepEnd) -> None:
        # Request ids travel only when the order changed (Invariants): the session resolves the rest.
        if msg.batch is not None and msg.batch.req_ids is not None:
            self.peer_req_ids = msg.batch.req_ids

    def take_mirror_updates(self) -> list[tuple[str, dict[str, Any]]]:
        return []  # no client can append to these requests

    def sync(self) -> None:
        pass  # every step message was handled when it was "sent"

    # -- tensors ----------------------------------------------------------------

    @property
    def sends_hidden(self) -> bool:
        return self.needs.hidden_states

    def claim_slot(self, step: int, wait_answered: Callable[[int], None]) -> HeldSlot:
        return HeldSlot()

    def read_states(self, plan: StepPlan) -> dict[str, Any]:
        # The mirror must not alias the hooks' state: the model's updates reach the hooks
        # separately (on_model_results) and would be merged twice. Host copies, as the shim makes.
        return {r: _map_tensors(v, lambda t: t.to("cpu", copy=True)) for r, v in plan.model_states.items()}

    def read_plan(self, plan: StepPlan, input_batch: Any, model: Any, embeds: torch.Tensor | None) -> dict[str, Any]:
        extra: dict[str, Any] = {}
        if plan.extra_kwargs:
            # As the model gets them through the shim: tensors on its device (no copy when they are
            # there already), containers as they are.
            device = model_device(model)
            extra = _map_tensors(plan.extra_kwargs, lambda t: t if t.device == device else t.to(device))
        if plan.overlays:
            extra["inputs_embeds"] = _overlay(plan.overlays, input_batch, model, embeds)
        return extra

    def stats(self) -> dict[str, Any]:
        return {"arena_kind": "inproc", "arena_opens": {}, "ring_counts": {}}

    # -- outputs, as a control client would read them (omni_sidecar/serve/queries.py) ---------

    def outputs(self, req_id: str) -> dict[str, Any] | None:
        """A request's assembled outputs: a live one's so far, else its finished entry's."""
        live = self.session.resolve(req_id)
        if live is not None:
            return self.hooks.get_outputs(live)
        entry = self.finished.get(req_id)
        return None if entry is None else entry.outputs

    def close(self) -> None:
        self.session.close()


def _overlay(overlays: list[Overlay], input_batch: Any, model: Any, embeds: torch.Tensor | None) -> torch.Tensor:
    """The plan's rows into the step's inputs_embeds (the persistent buffer when there is one),
    with the shim's checks (worker_shim/step/plan_read.py), all checked before any is written."""
    if embeds is None:
        n = int(input_batch.num_tokens_after_padding)
        embeds = model.embed_input_ids(input_batch.input_ids[:n])
    checked = []
    for ov in overlays:
        rows: torch.Tensor = ov.rows  # type: ignore[assignment]
        end = ov.row_start + rows.shape[0]
        if end > int(input_batch.num_tokens) or rows.dim() != 2 or rows.shape[1] != embeds.shape[1]:
            raise SidecarError(f"overlay rows [{ov.row_start}, {end}) x {list(rows.shape)} do not fit the "
                               f"batch of {input_batch.num_tokens} tokens x {embeds.shape[1]}")
        checked.append((ov.row_start, end, rows))
    for start, end, rows in checked:
        embeds[start:end].copy_(rows.to(device=embeds.device, dtype=embeds.dtype))
    return embeds
