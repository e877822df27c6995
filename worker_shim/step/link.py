"""One runner's steps with its sidecar: the runner's hooks call in here, and nowhere else.

The runner mixin calls `begin_step` / `ask_early` / `pre_forward` / `end_step` (or
`abort_step` when upstream raised). Which message each point of a step sends and what it
waits for is the step protocol's (worker_shim/step/protocol.py); the messages go straight to
the port (worker_shim/step/port.py) that `Recovery` holds. Recovery is entered only when the
port reports a loss or a hand-over (a step message raised, or the channel holds a SwitchAck,
a result's `switch_to`, a peer gone): it owns every such case (worker_shim/session/recovery.py)
and hands back the sidecar that serves the rest of the step, or none.

The plan: when the hooks' declared needs say the batch needs the sidecar before the forward,
the StepBegin goes as soon as vLLM has built the batch (`ask_early`, from the runner's
`prepare_inputs`) and the plan is taken in `pre_forward`, after vLLM built the attention
metadata and the embeds: the sidecar plans meanwhile, and the step's one wait is only what is
left of its work (docs/ARCHITECTURE.md, Step sequence). A caller that did not ask early asks in
`pre_forward`. After the forward, `end_step` sends the step's record (worker_shim/step/step_end.py).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable

import torch

from proto.messages import HookNeeds, RequestError, StepBegin, StepEnd, StepTick
from proto.settings import ERROR_TEXT_MAX, TIMINGS_KEPT
from worker_shim.config import EmbedsSetting, LossPolicy
from worker_shim.errors import SidecarError
from worker_shim.model.bridge import ModelBridge
from worker_shim.session.recovery import IDLE_RECONNECT_WAIT_MS, STEP_FAILURES, Recovery
from worker_shim.session.requests import FailureReports, SessionRequests
from worker_shim.step.batch import BatchReader, PayloadTracker, new_request, payload_of
from worker_shim.step.discards import DiscardWatch
from worker_shim.step.finishes import FinishWatch
from worker_shim.step.port import Connect, RecoveryPort, SidecarPort
from worker_shim.step.protocol import StepNews, after_forward, before_forward
from worker_shim.step.step_end import ModelResults, StepEnds
from worker_shim.upstream.compat import client_request_id, prompt_len_of

log = logging.getLogger("vllm.omni_sidecar.shim.link")


@dataclass
class StepCounters:
    """What the shim sent and measured (read through the worker's `omni_sidecar_stats`)."""

    steps: int = 0
    new_requests: int = 0
    finished_requests: int = 0
    scheduled_tokens: int = 0
    blocking_exchanges: int = 0
    asked_early: int = 0  # of which the StepBegin went when vLLM built the batch (`ask_early`)
    states_asked: int = 0  # requests whose state the model's hooks asked the sidecar for
    # Each plan's wait and read: from the StepBegin's send when pre_forward sent it, from pre_forward when
    # it went early (`ask_early`).
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

    @staticmethod
    def record_timing(samples: list[float], value: float) -> None:
        """Append a per-step timing, keeping the latest TIMINGS_KEPT (trimmed in chunks: O(1) a step)."""
        samples.append(value)
        if len(samples) > 2 * TIMINGS_KEPT:
            del samples[:-TIMINGS_KEPT]


@dataclass
class EarlyAsk:
    """A StepBegin sent by `ask_early`, its plan not yet taken."""

    port: SidecarPort
    input_batch: Any
    msg: StepBegin
    want: list[str]


class SidecarLink:
    """The runner's side of the step protocol (rank 0, or the only rank)."""

    def __init__(self, connect: Connect, first: RecoveryPort, loss_policy: LossPolicy = "fail-all",
                 embeds_setting: EmbedsSetting = "auto", suffixed_ids: bool = True,
                 payloads: PayloadTracker | None = None, length_finishes: bool = True,
                 batches: BatchReader | None = None, async_scheduling: bool = False) -> None:
        self.embeds_setting = embeds_setting  # read by the runner when it loads the model
        self.payloads = payloads if payloads is not None else PayloadTracker()
        self.batches = batches if batches is not None else BatchReader()  # how this vLLM's batch reads
        self.requests = SessionRequests(self.payloads)
        self.notices = self.requests.notices  # what the next step message tells the sidecar
        self.failures = FailureReports(lambda req_id: client_request_id(req_id, suffixed_ids))
        self.finishes = FinishWatch(length_finishes)
        self.discards = DiscardWatch(async_scheduling)
        self.recovery = Recovery(connect, first, self.requests, self.failures, loss_policy)
        self.counters = StepCounters()
        self.ends = StepEnds(self.notices, self.batches, self.failures, self.counters)
        self._suffixed_ids = suffixed_ids  # does vLLM add a suffix to the client's request id
        self.step = 0
        self._in_step = False
        self._layout_to: SidecarPort | None = None  # the sidecar this step's layout went to (in a StepBegin)
        self._early: EarlyAsk | None = None  # this step's StepBegin, sent before its plan is taken
        self._step_exchange_us = 0.0
        self._last_post_us = 0.0  # reported on the next StepEnd (measured after sending)
        self.mirror_sink: Callable[[str, dict[str, Any]], None] | None = None  # the bridge's, set at load

    @property
    def conn(self) -> RecoveryPort | None:
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
        news |= self.discards.take_held(finished)  # told by length, not yet sent: ended a step earlier
        self.counters.finished_requests += len(news)
        self.payloads.note_finished(finished)
        self.requests.note_finished(news, preempted or ())
        if news:
            self.notices.discarded.extend(self.discards.discarded(news))

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

    def note_model_errors(self, errors: dict[str, str]) -> None:
        """Requests whose model hooks failed in this step: the sidecar's clients learn it."""
        for req_id, message in errors.items():
            self.failures.fail(req_id, message)

    def note_sampled(self, output: Any) -> None:
        """The sampler output of the step that just ended (upstream sample_tokens); read only at shutdown."""
        self.finishes.note_sampled(self.step - 1, output)

    # -- the step ---------------------------------------------------------------

    def begin_step(self) -> None:
        self._in_step = True
        self._layout_to = None
        self.notices.step_started()
        if self.mirror_sink is not None:  # only a model with its own hooks mirrors state
            self._apply_mirror_updates()
        port = self.conn
        if (port is None or port.channel.switch_ack is not None or port.channel.switch_to
                or port.channel.peer_gone()):  # one look a step: a poll costs µs
            self.recovery.at_step_start(self.step)  # lost, handed over or gone: replaced, then announced
        else:
            self.recovery.announce(self.step)

    def _apply_mirror_updates(self) -> None:
        """Appends to mirrored state the sidecar sent since (MirrorUpdate): into the mirror before this
        step's hooks run; this step's StepStart (or a SwitchReady) says so. A non-blocking read; not
        the model's updates (docs/ARCHITECTURE.md, Streaming payloads)."""
        port, sink = self.conn, self.mirror_sink
        if port is None or sink is None:
            return
        try:
            self.failures.note_results(port.channel.take_results())
            for req_id, entries in port.take_mirror_updates():
                sink(req_id, entries)
        except (SidecarError, ValueError) as exc:  # ValueError: entries that do not merge (a span gap)
            self.recovery.lose(f"step {self.step}: {exc}")

    def mirror_updates_waiting(self) -> int:
        """Between steps: read what the sidecar sent (no waiting); the MirrorUpdates the next step
        start will apply."""
        port = self.conn
        if self._in_step or port is None or self.mirror_sink is None:
            return 0
        try:
            self.failures.note_results(port.channel.take_results())
        except SidecarError as exc:
            self.recovery.lose(f"between steps: {exc}")
            return 0
        return len(port.channel.mirror_updates)

    def reconnect_idle(self) -> bool:
        """Between steps, with the sidecar lost (or gone while vLLM idled): take up one that was
        started again and answers (its supervisor asks) now, not at the next step (an idle engine
        runs none), and tell it at once how the requests its predecessor's loss ended failed, so
        their clients learn it while vLLM idles. True when connected."""
        if self._in_step:
            return self.conn is not None
        self.recovery.drop_if_gone()
        if self.conn is not None:
            return True
        if not self.recovery.reconnect_waiting(IDLE_RECONNECT_WAIT_MS):
            return False
        port = self.conn
        try:
            self._send_notices(port, [])
        except (SidecarError, ValueError) as exc:
            self.recovery.lose(f"between steps: {exc}")
        return self.conn is not None

    def ask_early(self, input_batch: Any, bridge: ModelBridge | None = None) -> None:
        """The StepBegin, sent as soon as vLLM has built the step's batch (the runner's
        `prepare_inputs`), when the batch needs a plan; `pre_forward` takes the plan."""
        self._drop_early()
        port = self.conn
        if port is None or not self._in_step:
            return
        want = self._want_states(port, input_batch, bridge)
        if not self._needs_plan(port, input_batch, want):
            return
        try:
            msg = self._step_begin(port, input_batch, want, bridge)
            port.ask_plan(msg)
        except STEP_FAILURES as exc:
            self.recovery.fail(self.step, exc, port)
            return
        self._early = EarlyAsk(port, input_batch, msg, want)

    def _drop_early(self) -> None:
        """The plan asked early, taken and dropped (its errors recorded): the next answer read is the
        next message's."""
        early, self._early = self._early, None
        if early is None or early.port is not self.conn:
            return
        try:
            plan = early.port.take_plan(early.msg)
        except STEP_FAILURES as exc:
            self.recovery.fail(self.step, exc, early.port)
            return
        self.failures.record(plan.errors)

    def abort_step(self) -> None:
        """Upstream raised inside execute_model: no StepEnd for this step (a plan asked early is
        taken and dropped: the next answer read must be the next message's)."""
        self._in_step = False
        self.discards.note_step(self.step, None)
        self._drop_early()

    def pre_forward(self, input_batch: Any, model: Any, embeds: torch.Tensor | None = None,
                    bridge: ModelBridge | None = None) -> dict[str, Any]:
        """The step's plan, when the hooks need one for this batch: extra model inputs.

        `embeds` is the persistent inputs_embeds buffer when the runner feeds the model from one
        (overlay rows land in it). With a `bridge` (the model carries its own hooks), requests whose
        state the shim's mirror lacks are asked for in the same exchange (docs/ARCHITECTURE.md,
        "Model hooks")."""
        early, self._early = self._early, None
        if early is not None and early.input_batch is not input_batch:
            # Not this batch's (never from vLLM's runner, which builds one batch a step): its plan
            # dropped, this one asked afresh (the sidecar then plans the step twice).
            self._early = early
            self._drop_early()
            early = None
        port = self.conn
        while port is not None:
            try:
                extra = self._plan(port, early, input_batch, model, embeds, bridge)
                if extra is None and port.channel.pongs_due:  # no plan's round trip took the StepStart's answer
                    port.channel.await_pongs()
                return extra if extra is not None else {}
            except STEP_FAILURES as exc:
                # The successor when the session was handed over before the sidecar read this step (it
                # decides afresh from its own needs), else None.
                port = self.recovery.fail(self.step, exc, port)
        return {}

    def _serving(self) -> SidecarPort | None:
        """The sidecar that takes the rest of the step, once the StepStart's answer, if still due, came."""
        port = self.conn
        while port is not None and port.channel.pongs_due:
            try:
                port.channel.await_pongs()
            except STEP_FAILURES as exc:
                port = self.recovery.fail(self.step, exc, port)
        return port

    def _plan(self, port: SidecarPort, early: EarlyAsk | None, input_batch: Any, model: Any,
              embeds: torch.Tensor | None, bridge: ModelBridge | None) -> dict[str, Any] | None:
        """Ask `port` for this batch's plan (or take the one asked early) and read it: the step's one
        wait. None when the batch needs no plan."""
        counters = self.counters
        if early is not None and early.port is port:
            want = early.want
            t0 = time.perf_counter()
            plan = port.take_plan(early.msg)
            counters.asked_early += 1
        else:
            want = self._want_states(port, input_batch, bridge)
            if not self._needs_plan(port, input_batch, want):
                return None
            t0 = time.perf_counter()
            plan = port.step_plan(self._step_begin(port, input_batch, want, bridge))
        counters.blocking_exchanges += 1
        counters.states_asked += len(want)
        if plan.errors:
            self.failures.record(plan.errors)
        t1, c1 = time.perf_counter(), time.thread_time()
        states = port.read_states(plan) if want and bridge is not None else None  # before the plan's reuse
        extra = port.read_plan(plan, input_batch, model, embeds)
        counters.record_timing(counters.plan_read_us, (time.perf_counter() - t1) * 1e6)
        counters.record_timing(counters.plan_read_cpu_us, (time.thread_time() - c1) * 1e6)
        if states is not None:
            bridge.fill_states(states, failed={e.req_id for e in plan.errors})  # type: ignore[union-attr]
        self._step_exchange_us = (time.perf_counter() - t0) * 1e6
        counters.record_timing(counters.exchange_us, self._step_exchange_us)
        return extra

    def _needs_plan(self, port: SidecarPort, input_batch: Any, want: list[str]) -> bool:
        """The step protocol's answer for this batch: does a StepBegin go before the forward?"""
        return before_forward(port.needs, input_batch.req_ids, partial(self.batches.prefilling, input_batch),
                              self.payloads.payload_reqs, self.requests.live, want).send is not None

    @staticmethod
    def _want_states(port: SidecarPort, input_batch: Any, bridge: ModelBridge | None) -> list[str]:
        """Requests of the batch whose state the model's mirror lacks (when the hooks hand states out)."""
        return bridge.missing_states(input_batch.req_ids) if bridge is not None and port.needs.model_states else []

    def _step_begin(self, port: SidecarPort, input_batch: Any, want: list[str], bridge: ModelBridge | None) -> StepBegin:
        self._release_length_finishes()
        new, finished, preempted, discarded = self.notices.take()
        self._layout_to = port
        return StepBegin(step=self.step, batch=self.batches.layout(input_batch, port.peer_req_ids, port.needs.input_ids),
                         new_requests=new, finished=finished, preempted=preempted, want_states=want,
                         model_hooks=bridge.wire if want and bridge is not None else None, discarded=discarded)

    def end_step(self, state: Any, model_results: ModelResults | None = None) -> None:
        """After upstream execute_model: the step's record, with what the sidecar has not seen yet.

        `model_results`: the step's model updates and outputs per request (model hooks)."""
        self._in_step = False
        if self._early is not None:  # asked, never taken (no model inputs were prepared after it)
            self._drop_early()
        t0 = time.perf_counter()
        counters = self.counters
        batch = state.input_batch if state is not None else None
        self._release_length_finishes()  # the previous step's, held for vLLM's notices of this one
        self.discards.note_step(self.step, batch.req_ids if batch is not None else None)
        num_tokens = 0
        if batch is not None:
            num_tokens = int(batch.num_tokens)
            counters.steps += 1
            counters.scheduled_tokens += num_tokens
        port = self._serving()
        if port is None:
            if batch is not None:
                self.finishes.forget_rows()  # a batch the length watch did not see
            self.step += 1
            return
        if batch is not None:
            # Their last sample is this step's; with async scheduling told with the next step's notices.
            ending = self.discards.hold(self.finishes.by_length(batch))
            if ending:
                counters.finished_requests += len(ending)
                self.requests.note_finished(ending, ())
        news = StepNews(
            forward=batch is not None,
            notices=self.notices.pending,
            failures=bool(self.failures.pending),
            hidden=batch is not None and port.sends_hidden and state.hidden_states is not None,
            model_results=bool(model_results and (model_results[0] or model_results[1])),
            step_open=port.step_open,
        )
        record = after_forward(port.needs, news).send
        if record is None:
            self.step += 1
            return
        exchange_us, self._step_exchange_us = self._step_exchange_us, 0.0
        try:
            if record is StepTick:
                self.ends.tick(port, self.step, num_tokens, exchange_us, self._last_post_us)
            else:
                self.ends.end(port, self.step, batch, state, num_tokens, model_results,
                              self._layout_to is not port, exchange_us, self._last_post_us)
        except STEP_FAILURES as exc:
            self.recovery.fail(self.step, exc, port)
        self.step += 1
        if batch is not None:
            self._last_post_us = post_us = (time.perf_counter() - t0) * 1e6
            counters.record_timing(counters.post_us, post_us)

    def _release_length_finishes(self) -> None:
        if not self.discards.held:  # always so with async scheduling off
            return
        held = self.discards.release()
        self.counters.finished_requests += len(held)
        self.requests.note_finished(held, ())

    def _send_notices(self, port: RecoveryPort, failed: list[RequestError]) -> None:
        """Between steps: a StepEnd of no forward with the queued notices and failures (and `failed`),
        and one round trip behind it. SidecarError or ValueError when the sidecar could not take it
        (the queued failures kept for the next one)."""
        new, finished, preempted, discarded = self.notices.take()
        pending = self.failures.take_pending()
        try:
            port.send(StepEnd(step=self.step, new_requests=new, finished=finished, preempted=preempted,
                              failed=pending + failed, discarded=discarded))
        except (SidecarError, ValueError):
            self.failures.pending[:0] = pending
            raise
        self.step += 1
        self.flush()

    # -- results and stats ---------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        self.flush()
        port, recovery = self.conn, self.recovery
        return {
            "hook_set": self.hook_set,
            "connected": port is not None,
            **dataclasses.asdict(self.counters),
            "losses": recovery.losses,
            "reconnects": recovery.reconnects,
            "switches": recovery.switches,
            "switch_us": list(recovery.switch_us),
            "request_errors": dict(self.failures.request_errors),
            **(port.stats() if port is not None else {"arena_kind": "", "arena_opens": {}, "ring_counts": {}}),
        }

    def flush(self) -> None:
        """Wait until the sidecar handled every step sent so far (if a sidecar is connected)."""
        self.recovery.flush()

    def close(self) -> None:
        """Worker shutdown: tell the sidecar how each live request ended, then disconnect.

        Requests whose last sampled token was a stop token completed; the rest were cut short by
        the shutdown and fail (docs/ARCHITECTURE.md, "Finish notices"). With async scheduling, those
        that stopped in the step before the last and ran in the last had that forward discarded."""
        self._release_length_finishes()
        port = self.conn
        live = sorted(self.requests.live)
        if port is not None and live:
            completed, discarded = self.finishes.stopped_by_token(self.discards.async_scheduling)
            self.notices.discarded.extend(d for d in discarded if d.req_id in self.requests.live)
            message = "vLLM shut down before the request finished"
            cut_short = [RequestError(r, message[:ERROR_TEXT_MAX]) for r in live if r not in completed]
            self.requests.note_finished(live, ())
            try:
                self._send_notices(port, cut_short)
            except (SidecarError, ValueError) as exc:
                log.warning("could not tell the sidecar how %d live request(s) ended: %s", len(live), exc)
            log.info("shutdown: told the sidecar %d live request(s) completed, %d were cut short",
                     len(live) - len(cut_short), len(cut_short))
        self.recovery.close()
