"""The step protocol between one runner and its sidecar: which message a step needs, and sending it.

The runner mixin calls `begin_step` / `ask_early` / `pre_forward` / `end_step`
(or `abort_step` when upstream raised). A step asks for a plan before the
forward only when the sidecar's declared needs say so for this batch
(worker_shim/step/plan_ask.py), and after it sends a StepEnd with what the sidecar
has not seen yet, or the fixed-size StepTick (worker_shim/step/step_end.py). Who the
sidecar is (loss, reconnect, hot-upgrade switch) is `Recovery`'s business;
tensors cross in worker_shim/step/slots.py; vLLM's batch is read in
worker_shim/step/batch.py.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from proto.messages import HookNeeds, RequestError, StepEnd
from proto.settings import ERROR_TEXT_MAX, TIMINGS_KEPT
from worker_shim.step.batch import PayloadTracker, new_request, payload_of
from worker_shim.errors import SidecarError
from worker_shim.upstream.compat import client_request_id, prompt_len_of
from worker_shim.config import EmbedsSetting, LossPolicy
from worker_shim.step.finishes import FinishWatch
from worker_shim.model.layers import LayerCapture
from worker_shim.step.plan_ask import EarlyAsk, PlanAsks
from worker_shim.session.recovery import Recovery
from worker_shim.session.requests import FailureReports, SessionRequests
from worker_shim.step.step_end import ModelResults, StepEndRecords

log = logging.getLogger("vllm.omni_sidecar.shim.link")


@dataclass
class StepCounters:
    """What the shim sent and measured (read through the worker's `omni_sidecar_stats`)."""

    steps: int = 0
    new_requests: int = 0
    finished_requests: int = 0
    scheduled_tokens: int = 0
    blocking_exchanges: int = 0
    asked_early: int = 0  # of which the StepBegin went when vLLM built the batch (worker_shim/step/plan_ask.py)
    states_asked: int = 0  # requests whose state the model's hooks asked the sidecar for
    # Each plan's wait and read: from the StepBegin's send when pre_forward sent it, from pre_forward when
    # it went early (worker_shim/step/plan_ask.py); before 2026-12-02 every plan was a whole round trip.
    exchange_us: list[float] = field(default_factory=list)
    plan_read_us: list[float] = field(default_factory=list)  # of which reading the plan (its tensors copied out)
    post_us: list[float] = field(default_factory=list)  # shim-side cost of each StepEnd (copy + send)
    # This thread's CPU time in the plan read and in each StepEnd's record (not a StepTick's): against
    # the wall times above, what of them was our work and what waiting for the GIL or a core (vLLM's
    # other threads, the host).
    plan_read_cpu_us: list[float] = field(default_factory=list)
    step_end_cpu_us: list[float] = field(default_factory=list)
    # Host time in the model's own hooks per step (preprocess, talker_mtp, postprocess, state mirror):
    # work vllm-omni's runner does too, told apart from the shim's own cost.
    model_hook_us: list[float] = field(default_factory=list)


class SidecarLink(PlanAsks, StepEndRecords):
    """The runner's side of the step protocol (rank 0, or the only rank)."""

    def __init__(self, connect: Callable[..., Any], first: Any, loss_policy: LossPolicy = "fail-all",
                 embeds_setting: EmbedsSetting = "auto", suffixed_ids: bool = True,
                 payloads: PayloadTracker | None = None, length_finishes: bool = True) -> None:
        self.embeds_setting = embeds_setting  # read by the runner when it loads the model
        self.payloads = payloads if payloads is not None else PayloadTracker()
        self.requests = SessionRequests(self.payloads)
        self.failures = FailureReports(lambda req_id: client_request_id(req_id, suffixed_ids))
        self.finishes = FinishWatch(length_finishes)
        self.recovery = Recovery(connect, first, self.requests, self.failures, loss_policy)
        self._suffixed_ids = suffixed_ids  # does vLLM add a suffix to the client's request id
        self.step = 0
        self._in_step = False
        self._layout_sent = False
        self._early: EarlyAsk | None = None  # this step's StepBegin, sent before its plan is taken
        self.counters = StepCounters()
        self._step_exchange_us = 0.0
        self._last_post_us = 0.0  # reported on the next StepEnd (measured after sending)
        self.layer_capture: LayerCapture | None = None  # set by the runner at load (hidden_layers)
        self.mirror_sink: Callable[[str, dict[str, Any]], None] | None = None  # the bridge's, set at load

    @property
    def conn(self) -> Any:
        return self.recovery.conn

    @property
    def needs(self) -> HookNeeds:
        return self.conn.needs if self.conn is not None else HookNeeds()

    @property
    def hook_set(self) -> str:
        return self.conn.hook_set if self.conn is not None else ""

    @property
    def in_step(self) -> bool:
        """Between begin_step and end_step: model inputs prepared now belong to a real step."""
        return self._in_step

    # -- notes from upstream calls ----------------------------------------------

    def note_finished(self, finished: set[str], preempted: set[str] | None) -> None:
        if not finished and not preempted:  # most steps: nothing to note
            return
        news = set(finished) - self.finishes.already_told(finished)  # some the sidecar has from us
        self.counters.finished_requests += len(news)
        self.payloads.note_finished(finished)
        self.requests.note_finished(news, preempted or ())

    def note_new(self, new_reqs: list[Any]) -> None:
        if new_reqs and self.conn is None:
            self.recovery.reconnect_now()
        for req in new_reqs:
            payload = payload_of(req)
            self.counters.new_requests += 1
            self.payloads.note_new(req.req_id, payload)
            self.finishes.note_new(req, prompt_len_of(req))
            if self.conn is None:
                self.recovery.refuse(req.req_id, payload is not None)
                continue
            self.requests.admit(new_request(req, payload, self._suffixed_ids))

    # -- the step ---------------------------------------------------------------

    def begin_step(self) -> None:
        self._in_step = True
        self._layout_sent = False
        if self.mirror_sink is not None:  # only a model with its own hooks mirrors state
            self._apply_mirror_updates()
        self.recovery.at_step_start(self.step)

    def _apply_mirror_updates(self) -> None:
        """Appends to mirrored state the sidecar sent since (MirrorUpdate, protocol 1.4): into the
        mirror before this step's hooks run; this step's StepStart (or a SwitchReady) says so. A
        non-blocking read; not the model's updates (docs/ARCHITECTURE.md, Streaming payloads)."""
        conn = self.conn
        welcome = getattr(conn, "welcome", None)
        if welcome is None or self.mirror_sink is None or welcome.protocol_minor < 4:
            return
        try:
            self.recovery.note_results(conn.take_results())
            for req_id, entries in conn.take_mirror_updates():
                self.mirror_sink(req_id, entries)
        except (SidecarError, ValueError) as exc:  # ValueError: entries that do not merge (a span gap)
            self.recovery.lose(f"step {self.step}: {exc}")

    def mirror_updates_waiting(self) -> int:
        """Between steps: read what the sidecar sent (no waiting); the MirrorUpdates the next step
        start will apply."""
        conn = self.conn
        if self._in_step or getattr(conn, "welcome", None) is None or self.mirror_sink is None:
            return 0
        try:
            self.recovery.note_results(conn.take_results())
        except SidecarError as exc:
            self.recovery.lose(f"between steps: {exc}")
            return 0
        return conn.mirror_updates_waiting

    def abort_step(self) -> None:
        """Upstream raised inside execute_model: no StepEnd for this step (a plan asked early is
        taken and dropped: the next answer read must be the next message's)."""
        self._in_step = False
        self._drop_early()

    def end_step(self, state: Any, model_results: ModelResults | None = None) -> None:
        """After upstream execute_model: StepEnd with what the sidecar has not seen yet.

        `model_results`: the step's model updates and outputs per request (model hooks)."""
        self._in_step = False
        if self._early is not None:  # asked, never taken (no model inputs were prepared after it)
            self._drop_early()
        t0 = time.perf_counter()
        batch = state.input_batch if state is not None else None
        num_tokens = 0
        if batch is not None:
            num_tokens = int(batch.num_tokens)
            counters = self.counters
            counters.steps += 1
            counters.scheduled_tokens += num_tokens
        conn = self.recovery.conn
        if conn is not None and conn.answer_due:  # nothing of this step waited yet: now, once
            self.recovery.settle(self.step)
            conn = self.recovery.conn
        # A step announced with StepStart ends with a StepEnd, even an empty one (docs/ARCHITECTURE.md, Hot upgrade).
        if conn is None or (batch is None and not (self.requests.has_notices() or self.failures.pending
                                                   or conn.step_open)):
            if batch is not None:
                self.finishes.forget_rows()  # a batch the length watch did not see
            self.step += 1
            return
        if batch is not None:
            ending = self.finishes.by_length(batch)  # their last sample is this step's
            if ending:
                self.counters.finished_requests += len(ending)
                self.requests.note_finished(ending, ())
        try:
            if self._brings_nothing_new(conn, batch, state, model_results):
                self._send_step_tick(conn, num_tokens)
            else:
                self._send_step_end(conn, batch, state, num_tokens, model_results)
        except (SidecarError, ValueError) as exc:
            self.recovery.lose(f"step {self.step}: {exc}")
        self.step += 1
        if batch is not None:
            self._last_post_us = post_us = (time.perf_counter() - t0) * 1e6
            samples = counters.post_us
            samples.append(post_us)  # record_timing, inline: once a step
            if len(samples) > 2 * TIMINGS_KEPT:
                del samples[:-TIMINGS_KEPT]

    # -- results and stats ---------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        self.flush()
        conn, recovery = self.conn, self.recovery
        return {
            "hook_set": self.hook_set,
            "connected": conn is not None,
            **dataclasses.asdict(self.counters),
            "losses": recovery.losses,
            "reconnects": recovery.reconnects,
            "switches": recovery.switches,
            "switch_us": list(recovery.switch_us),
            "request_errors": dict(self.failures.request_errors),
            "arena_kind": conn.arena_kind if conn is not None else "",
            "arena_opens": conn.open_counts() if conn is not None else {},
            "ring_counts": conn.ring_counts() if conn is not None else {},
        }

    def flush(self) -> None:
        """Wait until the sidecar handled every step sent so far (if a sidecar is connected): the
        results of the StepEnds; StepTicks sent since are unanswered, so one Ping behind them
        (docs/ARCHITECTURE.md, Step sequence)."""
        conn = self.conn
        if conn is None or conn.last_sent_step < 0:
            return
        try:
            if conn.last_answered_step >= 0:
                self.recovery.note_results(conn.take_results(until_step=conn.last_answered_step))
            if conn.last_sent_step > conn.last_answered_step and conn.switch_ack is None:
                conn.sync()
        except SidecarError as exc:
            if conn.switch_ack is None:  # else handed over while idle: the next step switches
                self.recovery.lose(f"flush: {exc}")

    def note_model_errors(self, errors: dict[str, str]) -> None:
        """Requests whose model hooks failed in this step: the sidecar's clients learn it."""
        for req_id, message in errors.items():
            self.failures.fail(req_id, message)

    def note_sampled(self, output: Any) -> None:
        """The step's sampler output (upstream sample_tokens); read only at shutdown."""
        self.finishes.note_sampled(output)

    def close(self) -> None:
        """Worker shutdown: tell the sidecar how each live request ended, then disconnect.

        Requests whose last sampled token was a stop token completed; the rest were cut
        short by the shutdown and fail (docs/ARCHITECTURE.md, "Finish notices")."""
        conn = self.conn
        live = sorted(self.requests.live)
        if conn is not None and live:
            completed = self.finishes.stopped_by_token()
            message = "vLLM shut down before the request finished"
            cut_short = [RequestError(r, message[:ERROR_TEXT_MAX]) for r in live if r not in completed]
            self.requests.note_finished(live, ())
            new, finished, preempted = self.requests.take_notices()
            try:
                conn.send(StepEnd(step=self.step, new_requests=new, finished=finished, preempted=preempted,
                                  failed=self.failures.take_pending() + cut_short))
                self.step += 1
                self.flush()
            except (SidecarError, ValueError) as exc:
                log.warning("could not tell the sidecar how %d live request(s) ended: %s", len(live), exc)
            log.info("shutdown: told the sidecar %d live request(s) completed, %d were cut short",
                     len(live) - len(cut_short), len(cut_short))
        self.recovery.close()
