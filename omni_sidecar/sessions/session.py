"""One shim connection's requests and the hook calls per step.

Tensor moves live in omni_sidecar/sessions/arenas.py; what a finished request leaves for
clients in omni_sidecar/sessions/store.py.
"""

from __future__ import annotations

import time
from typing import Any

import msgspec

from omni_sidecar.sessions.appends import AppendQueue
from omni_sidecar.sessions.arenas import SessionArenas
from omni_sidecar.hook_api.guard import absorb_hook_error, collect_hook_errors
from omni_sidecar.hook_api.hook_set import OmniHooks, RequestInfo, StepBatch
from omni_sidecar.serve.metrics import SidecarMetrics
from omni_sidecar.sessions.plan_ahead import PlansAhead
from omni_sidecar.sessions.latency import LatencyWindow
from omni_sidecar.sessions.replays import SeenPositions, take_rows
from omni_sidecar.sessions.store import FinishedEntry, FinishedOutputs
from proto.messages import (
    BatchLayout,
    Discarded,
    Hello,
    ModelHooks,
    NewRequest,
    Overlay,
    RequestError,
    SessionStatus,
    StepBegin,
    StepEnd,
    StepPlan,
    StepResult,
    StepTick,
)
from proto.packed import StepLayout
from proto.plan_trees import decode_tree
from proto.settings import ERROR_TEXT_MAX


class Session:
    def __init__(
        self,
        session_id: int,
        hello: Hello,
        hooks: OmniHooks,
        finished: FinishedOutputs,
        metrics: SidecarMetrics,
    ) -> None:
        self.id = session_id
        self.hello = hello
        self.hooks = hooks
        hooks.async_scheduling = hello.async_scheduling
        self.finished_store = finished
        self.metrics = metrics
        self.arenas = SessionArenas(session_id, hello, metrics)
        self.connected_at = time.monotonic()
        self.requests: dict[str, RequestInfo] = {}
        self.errors_by_request: dict[str, str] = {}
        self.steps = 0
        self.new_requests = 0
        self.finished_requests = 0
        self.scheduled_tokens = 0
        self.errors = 0
        self.latency = LatencyWindow()
        self._client_ids: dict[str, str] = {}  # the client's id -> vLLM's, while they differ
        self._begin_us = 0.0
        self._last_layout: StepLayout | None = None
        self.seen = SeenPositions()  # hooks see each position once, also across preemption
        self.model_hooks: ModelHooks | None = None  # what the served model carries (told with want_states)
        self._prev_req_ids: list[str] | None = None
        self.appends = AppendQueue(self)  # streamed payloads, applied between steps
        self._late_errors: dict[str, str] = {}  # from work between steps: sent with the next answer
        self.stacked_rows = 0  # tensors the plans sent as rows of stacks (not those used whole)
        self.in_step = False  # a StepBegin was handled, its StepEnd (or StepTick) not yet
        # The next steady decode step's plan, built while the shim schedules it: hooks with pure plans
        # that the shim asks for every step (`pre_forward="always"`: else no StepBegin would take it).
        plans_ahead = getattr(hooks, "plans_ahead", False) and hooks.needs.pre_forward == "always"
        self.ahead = PlansAhead(self._plan, self.arenas, self.requests) if plans_ahead else None
        # Hooks that put nothing off (the base's no-op) cost no call, ring check or list after a StepEnd;
        # hooks that build no extra kwargs (the base's), no call in a step's plan.
        self.works_between_steps = type(hooks).between_steps is not OmniHooks.between_steps
        self._builds_kwargs = getattr(hooks.build_extra_kwargs, "__func__", None) is not OmniHooks.build_extra_kwargs

    # -- set-up --------------------------------------------------------------

    def open_arenas(self, min_out_bytes: int = 0) -> None:
        needs = self.hooks.needs
        self.arenas.open(needs.pre_forward != "never" or needs.model_states, min_out_bytes)
        self.arenas.wanted_layers = list(needs.hidden_layers)

    def close(self) -> None:
        self.appends.abandon("the engine's connection to this sidecar ended")
        self.arenas.close()

    def abandon(self, message: str) -> list[str]:
        """The shim is gone: its live requests end with `message` (clients get RequestFailed)."""
        live = list(self.requests)
        for req_id in live:
            self.errors_by_request.setdefault(req_id, message)
        self._report({r: message for r in live})
        self._finish(live)
        return live

    # -- hot upgrade -------------------------------------------------------------

    def export(self) -> dict[str, Any]:
        self.drop_plan_ahead()
        clients = {vllm_id: client_id for client_id, vllm_id in self._client_ids.items()}
        return {
            "requests": {r: [i.prompt_len, i.prompt_token_ids, i.payload, clients.get(r, "")]
                         for r, i in self.requests.items()},
            "errors": dict(self.errors_by_request),
            "counters": [self.steps, self.new_requests, self.finished_requests, self.scheduled_tokens,
                         self.errors],
            "seen": dict(self.seen.upto),
            "last_step": self.appends.last_step,  # what AppendReply.after_step counts from
            "model_hooks": msgspec.to_builtins(self.model_hooks),  # appends to mirrored state go to the shim
        }

    def import_(self, doc: dict[str, Any]) -> None:
        for req_id, (prompt_len, ids, payload, *client) in doc.get("requests", {}).items():
            self.requests[req_id] = RequestInfo(req_id, prompt_len, ids, payload)
            if client and client[0]:
                self._client_ids[client[0]] = req_id
        self.errors_by_request.update(doc.get("errors", {}))
        (self.steps, self.new_requests, self.finished_requests, self.scheduled_tokens,
         self.errors) = doc.get("counters", [0, 0, 0, 0, 0])
        self.seen.upto.update(doc.get("seen", {}))
        self.appends.last_step = doc.get("last_step", -1)
        if doc.get("model_hooks") is not None:
            self.model_hooks = msgspec.convert(doc["model_hooks"], ModelHooks)

    def resolve(self, req_id: str) -> str | None:
        """The live request a client names (by vLLM's id or by the id the client gave it)."""
        if req_id in self.requests:
            return req_id
        return self._client_ids.get(req_id)

    # -- per step ------------------------------------------------------------

    def step_begin(self, msg: StepBegin) -> StepPlan:
        # The one blocking exchange of a step: every layer here is on the shim's critical path,
        # hence the guards that skip work a steady step does not have (no admissions, no
        # states, hooks that return nothing).
        t0 = time.perf_counter()
        errors: dict[str, str] = {}
        self.in_step = True  # appends wait for its StepEnd
        self.hooks.current_step = msg.step
        self._discard(msg.discarded, errors)
        self._admit(msg.new_requests, msg.finished, msg.preempted, errors)
        layout = self._layout(msg.batch)
        self._last_layout = layout
        ahead = self.ahead.take(msg, layout) if self.ahead is not None else None
        if ahead is not None:  # built while the shim scheduled this step
            self._begin_us = ahead.hook_us + (time.perf_counter() - t0) * 1e6
            errors = self._with_late(ahead.errors)
            self.stacked_rows += ahead.stacked_rows
            return StepPlan(step=msg.step, overlays=ahead.overlays, extra_kwargs=ahead.extra_kwargs,
                            errors=self._report(errors) if errors else [], event=ahead.event, stacks=ahead.stacks)
        batch = StepBatch(msg.step, layout, self.requests)
        states = b""
        out = self.arenas.out
        if out is not None:
            out.reset()
        if msg.model_hooks is not None:
            self.model_hooks = msg.model_hooks
        if msg.want_states:
            with collect_hook_errors(errors, None, "model_states", list(msg.want_states)):
                states = self.arenas.encode_tree(self.hooks.model_states(list(msg.want_states)))
        overlays, extra = self._plan(batch, errors)
        event = out.seal() if out is not None else -1
        self._begin_us = (time.perf_counter() - t0) * 1e6
        errors = self._with_late(errors)
        stacks, rows = (out.stacks, out.stacked_rows) if out is not None else ([], 0)
        self.stacked_rows += rows
        return StepPlan(step=msg.step, overlays=overlays, extra_kwargs=extra,
                        errors=self._report(errors) if errors else [], event=event, model_states=states, stacks=stacks)

    def _plan(self, batch: StepBatch, errors: dict[str, str]) -> tuple[list[Overlay], bytes]:
        """The pre-forward hooks' overlays and extra kwargs' tree, their tensors in the arena."""
        overlays: list[Overlay] = []
        extra = b""
        try:
            overlays = self.arenas.write_overlays(self.hooks.prepare_prefill_embeds(batch))
            kwargs = self.hooks.build_extra_kwargs(batch) if self._builds_kwargs else None
            if kwargs:  # most hook sets build none: no tree to encode
                extra = self.arenas.encode_tree(kwargs)
        except Exception as exc:  # a hook bug never escapes (what `_collect` does, without its frames)
            absorb_hook_error(errors, exc, "pre-forward hooks", batch.req_ids)
        return overlays, extra

    def plan_ahead(self) -> None:
        """After a StepEnd is answered (the server calls it): omni_sidecar/sessions/plan_ahead.py."""
        if self.ahead is not None:
            self.ahead.build()

    def between_steps(self) -> None:
        """The work the hooks put off until the next plan is out (`OmniHooks.between_steps`): after
        `plan_ahead`, or after the StepBegin already waiting then (omni_sidecar/serve/peers.py)."""
        if self.works_between_steps:
            with collect_hook_errors(self._late_errors, None, "between_steps", list(self.requests)):
                self.hooks.between_steps()

    def _with_late(self, errors: dict[str, str]) -> dict[str, str]:
        """`errors` and those of the work between steps, which go out with the next answer."""
        if not self._late_errors:
            return errors
        errors, self._late_errors = {**self._late_errors, **errors}, {}
        return errors

    def drop_plan_ahead(self) -> None:
        """The hooks' state changes (an append, a hand-over): a plan built before is stale."""
        if self.ahead is not None:
            self.ahead.drop()

    def step_end(self, msg: StepEnd) -> StepResult:
        t0 = time.perf_counter()
        errors: dict[str, str] = {}
        self.drop_plan_ahead()
        self.hooks.current_step = msg.step
        self._discard(msg.discarded, errors)
        for failure in msg.failed:  # failed by the shim while no sidecar served them
            self.errors_by_request.setdefault(failure.req_id, failure.message)
            if failure.client_req_id and failure.req_id not in self.requests:
                self._client_ids.setdefault(failure.client_req_id, failure.req_id)
        self._admit(msg.new_requests, [], msg.preempted, errors)
        # The layout a StepEnd carries, else its StepBegin's.
        layout = self._layout(msg.batch) if msg.batch is not None else self._last_layout
        if msg.model_updates or msg.model_outputs:
            self._model_results(msg, errors)
        if msg.num_tokens and layout is not None:
            self.steps += 1
            self.scheduled_tokens += msg.num_tokens
            whole = StepBatch(msg.step, layout, self.requests)
            with collect_hook_errors(errors, whole, "process_model_output"):
                fresh, rows = self.seen.fresh_layout(layout)
                batch = whole if fresh is layout else StepBatch(msg.step, fresh, self.requests)  # steady: nothing seen before
                batch.hidden_layers = {n: take_rows(t, rows) for n, t in self.arenas.hidden_layers(msg).items()}
                self.hooks.process_model_output(batch, take_rows(self.arenas.hidden(msg), rows))
        self.arenas.release_slot(msg)
        self._last_layout = None
        result_errors = self._report(self._with_late(errors))
        self._finish(msg.finished)
        hook_us = (time.perf_counter() - t0) * 1e6 + self._begin_us
        self._begin_us = 0.0
        if msg.num_tokens:
            self.latency.record(hook_us)
            self._observe(msg, hook_us)
        self.in_step = False
        self.appends.step_ended(msg.step)  # appends that waited for the step apply now
        if self.ahead is not None and msg.num_tokens and layout is not None and not errors:
            self.ahead.note_ended(msg.step, layout)  # what the next step's plan is predicted from (after them)
        return StepResult(step=msg.step, errors=result_errors, hook_us=hook_us)

    def _model_results(self, msg: StepEnd, errors: dict[str, str]) -> None:
        """The model's updates and outputs to the hooks. A bad tensor in them fails the requests the
        trees name; trees that are not even msgpack fail the message (ValueError)."""
        try:
            updates, outputs = self.arenas.model_results(msg)
        except Exception as exc:  # a TreeError; a ref's ArenaError, TensorRefError or dtype
            named = [*decode_tree(msg.model_updates), *decode_tree(msg.model_outputs)]  # DecodeError: refused
            absorb_hook_error(errors, exc, "the model's results", named)
            return
        with collect_hook_errors(errors, None, "on_model_results", [*updates, *outputs]):
            self.hooks.on_model_results(updates, outputs)

    def step_tick(self, msg: StepTick) -> None:
        """A step that brought nothing new to hooks that read no per-step layout: no hook runs;
        it counts as a StepEnd of the same step would (status, /metrics, appends' `after_step`)."""
        hook_us, self._begin_us = self._begin_us, 0.0  # a StepBegin's hooks, if this step had one
        self._last_layout = None
        if msg.num_tokens:
            self.steps += 1
            self.scheduled_tokens += msg.num_tokens
            self.latency.record(hook_us)
            self._observe(msg, hook_us)
        self.in_step = False
        self.appends.step_ended(msg.step)

    def _observe(self, msg: StepEnd | StepTick, hook_us: float) -> None:
        m = self.metrics
        m.steps.inc()
        m.tokens.inc(msg.num_tokens)
        m.step_hook_seconds.observe(hook_us * 1e-6)
        if msg.shim_exchange_us:
            m.shim_exchange_seconds.observe(msg.shim_exchange_us * 1e-6)
        if msg.shim_post_us:
            m.shim_post_seconds.observe(msg.shim_post_us * 1e-6)
        m.arena_used_bytes.labels("shim_to_sidecar").set(msg.hidden.nbytes if isinstance(msg, StepEnd) and msg.hidden else 0)
        if self.arenas.out is not None:
            m.arena_used_bytes.labels("sidecar_to_shim").set(self.arenas.out.offset)

    def _discard(self, discarded: list[Discarded], errors: dict[str, str]) -> None:
        """Forwards vLLM discarded (async scheduling ran them before it read the request's finish):
        the hooks withdraw what those steps added to the requests' outputs, before the finish
        notices that come with them hand the outputs out."""
        if not discarded:
            return
        steps = {d.req_id: d.step for d in discarded if d.req_id in self.requests}
        if steps:
            with collect_hook_errors(errors, None, "on_discarded", list(steps)):
                self.hooks.on_discarded(steps)

    def _admit(
        self, new: list[NewRequest], finished: list[str], preempted: list[str], errors: dict[str, str]
    ) -> None:
        if not (new or finished or preempted):  # most steps of both step messages: nothing to admit
            return
        self.drop_plan_ahead()
        self._finish(finished)
        if preempted:
            self.metrics.requests.labels("preempted").inc(len(preempted))
            with collect_hook_errors(errors, None, "on_preempted", preempted):
                self.hooks.on_preempted(list(preempted))
        if not new:
            return
        infos = []
        for req in new:
            info = RequestInfo(req.req_id, req.prompt_len, req.prompt_token_ids, req.payload)
            self.requests[req.req_id] = info
            if req.client_req_id and req.client_req_id != req.req_id:
                self._client_ids[req.client_req_id] = req.req_id
            infos.append(info)
        self.new_requests += len(new)
        self.metrics.requests.labels("new").inc(len(new))
        with collect_hook_errors(errors, None, "on_new_requests", [r.req_id for r in new]):
            self.hooks.on_new_requests(infos)

    def _report(self, errors: dict[str, str]) -> list[RequestError]:
        for req_id, message in errors.items():
            self.errors_by_request.setdefault(req_id, message)
        self._count_errors(len(errors))
        return [RequestError(r, m[:ERROR_TEXT_MAX]) for r, m in errors.items()]

    def _count_errors(self, n: int) -> None:
        self.errors += n
        if n:
            self.metrics.request_errors.inc(n)

    def _finish(self, req_ids: list[str]) -> None:
        """Requests gone from vLLM: what they leave for clients goes to the finished store.

        An `on_finished` failure becomes the error of those requests (their outputs,
        still waiting for clients, are then not handed out as complete).
        """
        if not req_ids:
            return
        client_of = {vllm_id: client_id for client_id, vllm_id in self._client_ids.items()}
        for req_id in req_ids:
            client_id = client_of.get(req_id, "")
            error = self.errors_by_request.pop(req_id, "")
            if error:  # never hand out partial outputs as complete, nor make them
                entry = FinishedEntry(None, None, error)
            elif (deferred := self.hooks.deferred_outputs(req_id)) is not None:  # made when a client asks
                entry = FinishedEntry(None, None, deferred=deferred)
            else:
                entry = FinishedEntry(self.hooks.get_outputs(req_id), self.hooks.output_chunks(req_id))
            if entry.holds_anything:
                self.finished_store.put(req_id, entry, client_id)
            self.seen.forget((req_id,))
            if self.requests.pop(req_id, None) is not None:
                self.finished_requests += 1
                self.metrics.requests.labels("finished").inc()
            if client_id:
                del self._client_ids[client_id]
        failed: dict[str, str] = {}
        with collect_hook_errors(failed, None, "on_finished", list(req_ids)):
            self.hooks.on_finished(list(req_ids))
        for req_id, message in failed.items():
            self.finished_store.fail(req_id, message[:ERROR_TEXT_MAX], client_of.get(req_id, ""))
        self._count_errors(len(failed))

    def _layout(self, batch: BatchLayout) -> StepLayout:
        """A message's layout as hooks read it: request ids it omits (they equal the previous
        layout's) filled in, array lengths checked (LayoutError, a ValueError)."""
        req_ids = batch.req_ids if batch.req_ids is not None else self._prev_req_ids
        if req_ids is None:
            raise ValueError("batch layout omits req_ids but no earlier layout named them")
        layout = StepLayout.unpacking(req_ids, batch)
        self._prev_req_ids = req_ids
        return layout

    def status(self) -> SessionStatus:
        p50, p99 = self.latency.summary()
        h, opens, ahead = self.hello, self.arenas.opens, self.ahead
        return SessionStatus(
            session=self.id, rank=h.rank, world_size=h.world_size, vllm_version=h.vllm_version,
            platform=h.platform, model=h.model, connected_s=time.monotonic() - self.connected_at,
            steps=self.steps, new_requests=self.new_requests, finished_requests=self.finished_requests,
            scheduled_tokens=self.scheduled_tokens, errors=self.errors,
            step_latency_us_p50=p50, step_latency_us_p99=p99,
            arena_opens=opens.mem if opens is not None else 0,
            event_opens=opens.events if opens is not None else 0,
            plans_ahead_built=ahead.built if ahead is not None else 0,
            plans_ahead_used=ahead.used if ahead is not None else 0,
            stacked_rows=self.stacked_rows,
        )
