"""The plan a step asks for before its forward: the StepBegin, the step's one wait, the plan's read.

A mixin of worker_shim/step/link.py's `SidecarLink` (the step protocol), kept apart as its own concern, as
worker_shim/step/step_end.py keeps the record after the forward. When the hooks' declared needs say the
batch needs the sidecar before the forward, the StepBegin goes as soon as vLLM has built the batch
(`ask_early`, from the runner's `prepare_inputs`) and the plan is taken in `pre_forward`, after vLLM
built the attention metadata and the embeds: the sidecar plans meanwhile, and the step's one wait is
only what is left of its work (docs/ARCHITECTURE.md, Step sequence). A caller that did not ask early
(a test, a vLLM that builds its batch elsewhere) asks in `pre_forward`, as before.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import msgspec
import torch

from proto.messages import StepBegin, StepPlan
from worker_shim.step.batch import wire_layout
from worker_shim.errors import SidecarError
from worker_shim.model.bridge import ModelBridge
from worker_shim.step.step_end import record_timing


@dataclass
class EarlyAsk:
    """A StepBegin sent by `ask_early`, its plan not yet taken."""

    conn: Any
    input_batch: Any
    msg: StepBegin
    notices: tuple[list, list, list]
    want: list[str]


class PlanAsks:
    """Needs the link's `step`, `requests`, `payloads`, `failures`, `recovery`, `conn`, `counters`,
    `_in_step`, `_early`, `_layout_sent` and `_step_exchange_us`."""

    def ask_early(self, input_batch: Any, bridge: ModelBridge | None = None) -> None:
        """The StepBegin, sent as soon as vLLM has built the step's batch (the runner's
        `prepare_inputs`), when the batch needs a plan; `pre_forward` takes the plan. The sidecar
        plans while vLLM builds the attention metadata and the embeds: the step's one wait is what
        is left of the sidecar's work after those (docs/ARCHITECTURE.md, Step sequence)."""
        self._drop_early()
        conn = self.recovery.conn
        if conn is None or not self._in_step or (bridge is None and conn.needs.pre_forward == "never"):
            return
        want, needed = self._plan_needed(conn, input_batch, bridge)
        if not needed:
            return
        notices = self.requests.take_notices()
        try:
            msg = self._step_begin(conn, input_batch, notices, want, bridge)
            conn.ask_plan(msg)
        except SidecarError as exc:
            if self._handed_over(conn):  # pre_forward switches and asks the successor
                self._not_read(notices)
            else:  # a send that failed may still be queued: asking again could send the step twice
                self.recovery.lose(f"step {self.step}: {exc}")
            return
        except (ValueError, msgspec.ValidationError) as exc:  # a batch the wire cannot carry, as in pre_forward
            self.recovery.lose(f"step {self.step}: {exc}")
            return
        self._early = EarlyAsk(conn, input_batch, msg, notices, want)

    def _drop_early(self) -> bool:
        """The plan asked early, taken and dropped (its errors recorded): the next answer read is the
        next message's. Whether the sidecar read that StepBegin (its notices are then delivered)."""
        early, self._early = self._early, None
        if early is None or early.conn is not self.recovery.conn:
            return False
        try:
            plan = early.conn.take_plan(early.msg)
        except SidecarError as exc:
            if self._handed_over(early.conn):
                self._not_read(early.notices)
            else:
                self.recovery.lose(f"step {self.step}: {exc}")
            return False
        self.failures.record(plan.errors)
        return True

    def _not_read(self, notices: tuple[list, list, list]) -> None:
        """The sidecar handed the session over before it read the StepBegin that carried `notices`:
        they, and the layout, go to the successor with the step's next message."""
        self.requests.requeue(*notices)
        self._layout_sent = False

    @staticmethod
    def _handed_over(conn: Any) -> bool:
        """A SidecarError of this step's exchange means the session went to a successor before the
        sidecar read the step (not a loss) when a SwitchAck came and the quiet spell's answer did not
        (docs/ARCHITECTURE.md, Hot upgrade)."""
        return conn.switch_ack is not None and conn.answer_due

    def pre_forward(self, input_batch: Any, model: Any, embeds: torch.Tensor | None = None,
                    bridge: ModelBridge | None = None) -> dict[str, Any]:
        """Blocking StepBegin when the hooks need it; returns extra model inputs.

        `embeds` is the persistent inputs_embeds buffer when the runner feeds
        the model from one (worker_shim/step/slots.py `read_plan`). With a `bridge`
        (the model carries its own hooks), requests whose state the shim's mirror
        lacks are asked for in the same exchange (docs/ARCHITECTURE.md, "Model hooks").
        """
        early, self._early = self._early, None
        sent_notices = False  # a dropped early StepBegin carried them to the sidecar
        if early is not None and not (early.conn is self.recovery.conn and early.input_batch is input_batch):
            # Not this batch's (never from vLLM's runner, which builds one batch a step): its plan dropped,
            # this one asked afresh (the sidecar then plans the step twice).
            self._early = early
            sent_notices = self._drop_early()
            early = None
        conn = self.recovery.conn  # after the drop, which may have lost it
        if conn is None:
            return {}
        if early is not None:
            want, notices, msg = early.want, early.notices, early.msg
        else:
            if bridge is None and conn.needs.pre_forward == "never" and not conn.answer_due:
                return {}  # pass-through hooks: nothing to decide per batch
            want, needed = self._plan_needed(conn, input_batch, bridge)
            if not needed and conn.answer_due:  # the quiet spell's answer is this step's one wait
                self.recovery.settle(self.step)
                if self.conn is not conn:  # a successor (or none): its needs decide
                    return self.pre_forward(input_batch, model, embeds, bridge) if self.conn is not None else {}
            if not needed:
                return {}
            notices = ([], [], []) if sent_notices else self.requests.take_notices()
            msg = None
        t0 = time.perf_counter()
        try:
            if msg is None:
                plan = self._take_plan(conn, self._step_begin(conn, input_batch, notices, want, bridge), sent=False)
            else:
                plan = self._take_plan(conn, msg, sent=True)
            if plan is None:  # handed over before the sidecar read this step: the successor decides
                if self.conn is None:  # lost while switching: the loss failed the requests; finishes stay queued
                    self.requests.requeue([], notices[1], [])
                    return {}
                self._not_read(notices)
                return self.pre_forward(input_batch, model, embeds, bridge)
            self.counters.blocking_exchanges += 1
            self.counters.asked_early += msg is not None
            self.counters.states_asked += len(want)
            self.failures.record(plan.errors)
            t1, c1 = time.perf_counter(), time.thread_time()
            states = conn.read_states(plan) if want and bridge is not None else None  # before the plan's reuse
            extra = conn.read_plan(plan, input_batch, model, embeds)
            record_timing(self.counters.plan_read_us, (time.perf_counter() - t1) * 1e6)
            record_timing(self.counters.plan_read_cpu_us, (time.thread_time() - c1) * 1e6)
            if states is not None:
                bridge.fill_states(states, failed={e.req_id for e in plan.errors})
        except (SidecarError, ValueError, msgspec.ValidationError) as exc:
            self.recovery.lose(f"step {self.step}: {exc}")
            return {}
        self._step_exchange_us = (time.perf_counter() - t0) * 1e6
        record_timing(self.counters.exchange_us, self._step_exchange_us)
        return extra

    def _plan_needed(self, conn: Any, input_batch: Any, bridge: ModelBridge | None) -> tuple[list[str], bool]:
        """(requests whose state the mirror lacks, whether this batch needs a plan before the forward)."""
        want = bridge.missing_states(input_batch.req_ids) if bridge is not None and conn.needs.model_states else []
        return want, bool(want) or self.payloads.exchange_needed(conn.needs, input_batch, among=self.requests.live)

    def _step_begin(self, conn: Any, input_batch: Any, notices: tuple[list, list, list], want: list[str],
                    bridge: ModelBridge | None) -> StepBegin:
        new, finished, preempted = notices
        layout, packed = wire_layout(input_batch, conn)
        self._layout_sent = True
        return StepBegin(step=self.step, batch=layout, new_requests=new, finished=finished, preempted=preempted,
                         want_states=want, model_hooks=bridge.wire if want and bridge is not None else None,
                         packed=packed)

    def _take_plan(self, conn: Any, msg: StepBegin, sent: bool) -> StepPlan | None:
        """The StepBegin's plan (sent now unless `sent`), the step's one wait; it also takes the answer
        a quiet spell's StepStart asked for. None when the sidecar handed the session over before it
        read this step (switched: the successor has it)."""
        try:
            return conn.take_plan(msg) if sent else conn.step_plan(msg)
        except SidecarError:
            if not self._handed_over(conn):
                raise
        self._layout_sent = False  # the successor has seen nothing of this step (the notices: the caller's)
        self.recovery.settle(self.step)  # switches and announces the step to the successor
        return None
