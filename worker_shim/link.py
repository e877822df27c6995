"""Per-step traffic between one runner and its sidecar, and what happens when it goes away.

The runner mixin calls `begin_step` / `pre_forward` / `end_step`; this class
decides which messages a step needs (from the sidecar's declared needs), moves
tensors through the arenas and keeps the counters tests and `status` compare.

Liveness: a sidecar that dies (socket monitor), stalls past the step timeout,
or sends garbage is dropped at once; vLLM keeps serving. The requests it was
serving fail explicitly (logged, in `omni_sidecar_stats`, and reported to the
next sidecar so clients get `RequestFailed`); which others fail meanwhile is
the `loss_policy`. The shim reconnects in the background (a Hello waits in
the socket until a sidecar binds) and switches over at a step boundary.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

import msgspec
import torch

from proto.messages import (
    BatchLayout,
    HookNeeds,
    NewRequest,
    RequestError,
    StepBegin,
    StepEnd,
    StepPlan,
    SwitchAck,
    SwitchReady,
)
from proto.arena import ShmArena
from proto.tensors import TENSOR_MARKER, TensorRef
from worker_shim.channel import SidecarError
from worker_shim.connection import SidecarConnection
from omni_arena.views import arena_tensor, dtype_name

log = logging.getLogger("vllm.omni_sidecar.shim.link")
PAYLOAD_KEY = "omni_sidecar"
MAX_PENDING_FAILURES = 100_000
RETRY_AFTER_S = 10.0
RECONNECT_WAIT_MS = 200


def _socket_identity(endpoint: str) -> tuple[int, int] | None:
    """(inode, mtime) of the sidecar's socket file: a new sidecar binds a new one."""
    import os

    try:
        st = os.stat(endpoint[len("ipc://"):])
    except (OSError, ValueError):
        return None
    return st.st_ino, st.st_mtime_ns


class SidecarLink:
    def __init__(self, connect: Callable[..., SidecarConnection], first: SidecarConnection,
                 loss_policy: str = "fail-all", embeds_setting: str = "auto") -> None:
        self.embeds_setting = embeds_setting  # read by the runner when it loads the model
        self._connect = connect  # makes a fresh connection (new socket, new arena)
        self.conn: SidecarConnection | None = first
        self._pending: SidecarConnection | None = None
        self.loss_policy = loss_policy
        self.step = 0
        self.in_step = False
        self._new: list[NewRequest] = []
        self._finished: list[str] = []
        self._preempted: list[str] = []
        self._failures: list[RequestError] = []  # to tell the next sidecar
        self._live: set[str] = set()
        self._payload_reqs: set[str] = set()  # live requests that carry a sidecar payload
        self._layout_sent = False
        self._sent_req_ids: list[str] | None = None  # what the sidecar last saw
        self._last_sent_step = -1
        self._waited_sockets: set[tuple[int, int]] = set()
        # Counters (read through the worker's `omni_sidecar_stats`).
        self.steps = 0
        self.new_requests = 0
        self.finished_requests = 0
        self.scheduled_tokens = 0
        self.blocking_exchanges = 0
        self.losses = 0
        self.reconnects = 0
        self.switches = 0
        self.switch_us: list[float] = []  # stall of each hot-upgrade switch
        self._switch_to = ""
        self.request_errors: dict[str, str] = {}
        self.exchange_us: list[float] = []  # blocking StepBegin round trips
        self.post_us: list[float] = []  # shim-side cost of each StepEnd (copy + send)
        self._step_exchange_us = 0.0
        self._last_post_us = 0.0  # reported on the next StepEnd (measured after sending)

    @property
    def needs(self) -> HookNeeds:
        return self.conn.needs if self.conn is not None else HookNeeds()

    @property
    def hook_set(self) -> str:
        return self.conn.hook_set if self.conn is not None else ""

    # -- notes from upstream calls ----------------------------------------------

    def note_finished(self, finished: set[str], preempted: set[str] | None) -> None:
        """vLLM frees both kinds in finish_requests; the sidecar keeps state for preempted ones."""
        if finished:
            self._finished.extend(sorted(finished))
            self.finished_requests += len(finished)
            self._payload_reqs.difference_update(finished)
            self._live.difference_update(finished)
        if preempted:
            self._preempted.extend(sorted(preempted))

    def note_new(self, new_reqs: list[Any]) -> None:
        for req in new_reqs:
            payload = payload_of(req)
            self.new_requests += 1
            if self.conn is None:
                if self.loss_policy == "fail-all" or payload is not None:
                    self._fail(req.req_id, "no omni-sidecar was connected when the request arrived")
                continue
            if payload is not None:
                self._payload_reqs.add(req.req_id)
            self._live.add(req.req_id)
            self._new.append(
                NewRequest(
                    req_id=req.req_id,
                    # 0.32 has prompt_len (prompt_embeds prompts have no ids); 0.26 only the ids.
                    prompt_len=int(getattr(req, "prompt_len", None) or len(req.prompt_token_ids or [])),
                    prompt_token_ids=list(req.prompt_token_ids or []),
                    payload=payload,
                )
            )

    # -- the step ---------------------------------------------------------------

    def begin_step(self) -> None:
        self.in_step = True
        self._layout_sent = False
        if self.conn is None:
            self._try_reconnect()
        elif self._switch_to:
            self._switch()
        elif self.conn.channel.peer_gone():
            self._lose("the sidecar closed the connection (it crashed, was killed or stopped)")

    def needs_exchange(self, input_batch: Any) -> bool:
        """Does any scheduled request need the sidecar before this forward?"""
        if self.conn is None:
            return False
        return exchange_needed(self.needs, self._payload_reqs, input_batch)

    def pre_forward(self, input_batch: Any, model: Any, embeds: torch.Tensor | None = None) -> dict[str, Any]:
        """Blocking StepBegin when the hooks need it; returns extra model inputs.

        `embeds` is the persistent inputs_embeds buffer (already holding this
        step's token embeddings) when the runner feeds the model from one:
        overlay rows are written into it in place, so CUDA graphs see them.
        """
        if not self.needs_exchange(input_batch):
            return {}
        conn = self.conn
        assert conn is not None
        t0 = time.perf_counter()
        msg = StepBegin(
            step=self.step,
            batch=self._next_layout(input_batch),
            new_requests=self._new,
            finished=self._finished,
            preempted=self._preempted,
        )
        self._new, self._finished, self._preempted = [], [], []
        self._layout_sent = True
        try:
            plan: StepPlan = conn.channel.call(msg, StepPlan)  # type: ignore[assignment]
            self.blocking_exchanges += 1
            self._record_errors(plan.errors)
            extra = self._consume_plan(plan, input_batch, model, embeds)
        except (SidecarError, ValueError, msgspec.ValidationError) as exc:
            self._lose(f"step {self.step}: {exc}")
            return {}
        self._step_exchange_us = (time.perf_counter() - t0) * 1e6
        self.exchange_us.append(self._step_exchange_us)
        return extra

    def end_step(self, state: Any) -> None:
        """After upstream execute_model: StepEnd with what the sidecar has not seen yet."""
        self.in_step = False
        t0 = time.perf_counter()
        batch = state.input_batch if state is not None else None
        num_tokens = int(batch.num_tokens) if batch is not None else 0
        if batch is not None:
            self.steps += 1
            self.scheduled_tokens += num_tokens
        conn = self.conn
        if conn is None or (batch is None and not (self._new or self._finished or self._preempted
                                                   or self._failures)):
            self.step += 1
            return
        try:
            hidden_ref, hidden_event = None, -1
            if batch is not None and conn.ring is not None and state.hidden_states is not None:
                hidden_ref, hidden_event = self._write_hidden(conn, state.hidden_states[:num_tokens])
            msg = StepEnd(
                step=self.step,
                batch=None if (batch is None or self._layout_sent) else self._next_layout(batch),
                new_requests=self._new,
                finished=self._finished,
                preempted=self._preempted,
                hidden=hidden_ref,
                hidden_event=hidden_event,
                num_tokens=num_tokens,
                shim_exchange_us=self._step_exchange_us,
                shim_post_us=self._last_post_us,
                failed=self._failures,
            )
            self._new, self._finished, self._preempted, self._failures = [], [], [], []
            self._step_exchange_us = 0.0
            conn.channel.send(msg)
            self._last_sent_step = self.step
            if hidden_ref is not None:
                assert conn.ring is not None
                conn.ring.owner_step[conn.ring.slot_of(self.step)] = self.step
            self._note_results(conn.channel.take_results())
        except (SidecarError, ValueError) as exc:
            self._lose(f"step {self.step}: {exc}")
        self.step += 1
        if batch is not None:
            self._last_post_us = (time.perf_counter() - t0) * 1e6
            self.post_us.append(self._last_post_us)

    # -- loss and reconnect -------------------------------------------------------

    def _lose(self, reason: str) -> None:
        conn, self.conn = self.conn, None
        if conn is None:
            return
        self.losses += 1
        message = f"omni-sidecar lost ({reason}); its hooks did not run for this request"
        affected = sorted(self._live if self.loss_policy == "fail-all" else self._payload_reqs)
        for req_id in affected:
            self._fail(req_id, message)
        self._live.clear()
        self._payload_reqs.clear()
        self._new, self._preempted = [], []
        self._sent_req_ids = None
        self._last_sent_step = -1
        ident = _socket_identity(conn.channel.endpoint)
        if ident is not None:
            self._waited_sockets.add(ident)  # the dead sidecar's socket: do not wait on it
        log.error(
            "omni-sidecar at %s lost: %s. vLLM keeps serving; %d request(s) fail with a clear "
            "error (policy %s); reconnecting in the background (start a sidecar there).",
            conn.channel.endpoint, reason, len(affected), self.loss_policy,
        )
        conn.close()

    def _switch(self) -> None:
        """Hot upgrade at a step boundary: the old sidecar hands over, the new one resumes."""
        old, target = self.conn, self._switch_to
        self._switch_to = ""
        assert old is not None
        t0 = time.perf_counter()
        try:
            ack: SwitchAck = old.channel.call(SwitchReady(last_step=self._last_sent_step), SwitchAck)  # type: ignore[assignment]
            for result in old.channel.take_results():
                self._record_errors(result.errors)
            new = self._connect(endpoint=ack.endpoint, resume_token=ack.token)
            new.connect(timeout_s=max(5.0, old.channel.step_timeout_ms / 1000))
        except (SidecarError, ValueError) as exc:
            self._lose(f"switching to the new sidecar at {target} failed: {exc}")
            return
        old.close()
        self.conn = new
        self._sent_req_ids = None
        self._last_sent_step = -1
        self.switches += 1
        stall = (time.perf_counter() - t0) * 1e6
        self.switch_us.append(stall)
        log.warning("omni-sidecar hot upgrade: switched to %s (hook set %r) in %.1f ms at step %d",
                    ack.endpoint, new.hook_set, stall / 1e3, self.step)

    def _fail(self, req_id: str, message: str) -> None:
        self.request_errors[req_id] = message
        if len(self._failures) < MAX_PENDING_FAILURES:
            self._failures.append(RequestError(req_id, message[:4000]))

    def _try_reconnect(self) -> None:
        pending = self._pending
        if pending is None:
            try:
                pending = self._pending = self._connect()
                pending.start()
            except Exception as exc:  # e.g. no room for a new arena: try again later
                log.error("omni-sidecar reconnect attempt failed: %s", exc)
                self._pending = None
                return
        # A freshly bound sidecar answers within milliseconds: wait that long, once per new
        # socket, and never for the dead sidecar's leftover socket file.
        ident = _socket_identity(pending.channel.endpoint)
        wait = ident is not None and ident not in self._waited_sockets
        if wait:
            self._waited_sockets.add(ident)
        try:
            ready = pending.poll(RECONNECT_WAIT_MS if wait else 0)
        except (SidecarError, ValueError) as exc:
            log.error("omni-sidecar refused the reconnect: %s", exc)
            pending.close()
            self._pending = None
            return
        if ready:
            self.conn, self._pending = pending, None
            self.reconnects += 1
            assert pending.welcome is not None
            log.warning(
                "omni-sidecar reconnected at %s: hook set %r, session %d; %d failed request(s) "
                "reported to it", pending.channel.endpoint, pending.hook_set, pending.welcome.session,
                len(self._failures),
            )
        elif time.monotonic() - pending.started > RETRY_AFTER_S:
            pending.close()  # a fresh socket and arena next step
            self._pending = None

    # -- tensors ------------------------------------------------------------------

    def _next_layout(self, batch: Any) -> BatchLayout:
        layout = _layout(batch, self._sent_req_ids)
        if layout.req_ids is not None:
            self._sent_req_ids = layout.req_ids
        return layout

    def _write_hidden(self, conn: SidecarConnection, hidden: torch.Tensor) -> tuple[TensorRef, int]:
        ring, arena = conn.ring, conn.hidden_arena
        assert ring is not None and arena is not None
        slot = ring.slot_of(self.step)
        owner = ring.owner_step[slot]
        if owner is not None:
            # The sidecar may still be reading this slot: wait (up to the step timeout) for its result.
            self._note_results(conn.channel.take_results(until_step=owner))
            ring.owner_step[slot] = None
        nbytes = hidden.numel() * hidden.element_size()
        if nbytes > ring.slot_size:
            raise SidecarError(
                f"hidden states of {nbytes} bytes exceed the arena slot of {ring.slot_size}"
            )
        ref = TensorRef(0, ring.offset(slot), nbytes, list(hidden.shape), dtype_name(hidden.dtype))
        if isinstance(arena, ShmArena):
            arena_tensor(arena, ref).copy_(hidden)  # host staging (CPU, or accelerators without IPC)
            return ref, -1
        arena.wait_done(slot)  # the sidecar's reads of this slot's previous use
        arena.tensor(ref).copy_(hidden, non_blocking=True)
        return ref, arena.mark_ready(slot)

    def _consume_plan(self, plan: StepPlan, input_batch: Any, model: Any,
                      embeds: torch.Tensor | None) -> dict[str, Any]:
        """Copy the plan's tensors out of the sidecar's arena (device arenas: ordered by events)."""
        if not (plan.extra_kwargs or plan.overlays):
            return {}
        arena = self.conn.overlay_arena if self.conn is not None else None
        device_arena = arena is not None and not isinstance(arena, ShmArena)
        if device_arena and plan.event >= 0:
            arena.wait_ready(plan.event)  # the sidecar's writes, ordered on our stream
        extra: dict[str, Any] = {}
        if plan.extra_kwargs:
            device = model_device(model)
            extra = {k: self._decode_kwarg(v, device, 0) for k, v in plan.extra_kwargs.items()}
        if plan.overlays:
            extra["inputs_embeds"] = self._overlay(plan, input_batch, model, embeds)
        if device_arena:
            arena.mark_done(0)  # the sidecar may rewrite its arena once our copies ran
        return extra

    def _overlay(self, plan: StepPlan, input_batch: Any, model: Any,
                 embeds: torch.Tensor | None) -> torch.Tensor:
        arena = self.conn.overlay_arena if self.conn is not None else None
        if arena is None:
            raise SidecarError("sidecar sent overlays but offered no arena")
        if embeds is None:
            n = int(input_batch.num_tokens_after_padding)
            embeds = model.embed_input_ids(input_batch.input_ids[:n])
        checked = []  # all overlays are checked before any is written: the buffer may be the model's
        for ov in plan.overlays:
            rows = arena_tensor(arena, ov.rows)
            end = ov.row_start + rows.shape[0]
            if end > int(input_batch.num_tokens) or rows.dim() != 2 or rows.shape[1] != embeds.shape[1]:
                raise SidecarError(
                    f"overlay rows [{ov.row_start}, {end}) x {list(rows.shape)} do not fit the "
                    f"batch of {input_batch.num_tokens} tokens x {embeds.shape[1]}"
                )
            checked.append((ov.row_start, end, rows))
        for start, end, rows in checked:
            embeds[start:end].copy_(rows.to(device=embeds.device, dtype=embeds.dtype))
        return embeds

    def _decode_kwarg(self, value: Any, device: torch.device, depth: int) -> Any:
        """Tensor markers become tensors (copied out of the arena onto the model's device)."""
        if depth > 8:
            raise SidecarError("sidecar extra kwargs nest deeper than 8 levels")
        if isinstance(value, dict):
            if TENSOR_MARKER in value:
                arena = self.conn.overlay_arena if self.conn is not None else None
                if arena is None:
                    raise SidecarError("sidecar sent tensor kwargs but offered no arena")
                ref = msgspec.convert(value[TENSOR_MARKER], TensorRef)
                return arena_tensor(arena, ref).to(device, copy=True)
            return {k: self._decode_kwarg(v, device, depth + 1) for k, v in value.items()}
        if isinstance(value, list):
            return [self._decode_kwarg(v, device, depth + 1) for v in value]
        return value

    def _note_results(self, results: list[Any]) -> None:
        for result in results:
            self._record_errors(result.errors)
            if result.switch_to:
                self._switch_to = result.switch_to

    def _record_errors(self, errors: list[Any]) -> None:
        for err in errors:
            if err.req_id not in self.request_errors:
                log.error("omni-sidecar hook error for request %s: %s", err.req_id, err.message)
            self.request_errors[err.req_id] = err.message

    def stats(self) -> dict[str, Any]:
        self.flush()
        return {
            "hook_set": self.hook_set,
            "connected": self.conn is not None,
            "steps": self.steps,
            "new_requests": self.new_requests,
            "finished_requests": self.finished_requests,
            "scheduled_tokens": self.scheduled_tokens,
            "blocking_exchanges": self.blocking_exchanges,
            "losses": self.losses,
            "reconnects": self.reconnects,
            "switches": self.switches,
            "switch_us": list(self.switch_us),
            "request_errors": dict(self.request_errors),
            "exchange_us": list(self.exchange_us),
            "post_us": list(self.post_us),
            "arena_kind": self.conn.arena_kind if self.conn is not None else "",
            "arena_opens": self.conn.open_counts() if self.conn is not None else {},
        }

    def flush(self) -> None:
        """Wait for the results of every step sent so far (if a sidecar is connected)."""
        conn = self.conn
        if conn is None or self._last_sent_step < 0:
            return
        try:
            self._note_results(conn.channel.take_results(until_step=self._last_sent_step))
        except SidecarError as exc:
            self._lose(f"flush: {exc}")

    def close(self) -> None:
        for conn in (self.conn, self._pending):
            if conn is not None:
                conn.close()
        self.conn = self._pending = None


def exchange_needed(needs: HookNeeds, payload_reqs: set[str], input_batch: Any) -> bool:
    """The declared needs applied to one batch (also TP ranks' broadcast schedule)."""
    mode = needs.pre_forward
    if mode == "never":
        return False
    if needs.pre_forward_scope == "all":
        return mode == "always" or bool(_prefilling(input_batch).any())
    if not payload_reqs:
        return False
    ids = input_batch.req_ids
    if mode == "always":
        return any(r in payload_reqs for r in ids)
    prefilling = _prefilling(input_batch)
    return any(prefilling[i] and r in payload_reqs for i, r in enumerate(ids))


def payload_of(req: Any) -> dict | None:
    """The request's sidecar payload (`extra_args["omni_sidecar"]`), if it carries one."""
    sp = req.sampling_params
    extra = (sp.extra_args or {}) if sp is not None else {}
    payload = extra.get(PAYLOAD_KEY)
    return payload if isinstance(payload, dict) else None


def _prefilling(batch: Any) -> Any:
    """Per-row "still in prefill" flags (upstream's own array when it has one, as 0.32 does)."""
    flags = getattr(batch, "is_prefilling_np", None)
    if flags is not None:
        return flags
    n = len(batch.req_ids)
    return batch.num_computed_tokens_np[:n] < batch.prefill_len_np[:n]


def model_device(model: Any) -> torch.device:
    for param in model.parameters():
        return param.device
    return torch.device("cpu")


def _layout(batch: Any, prev_ids: list[str] | None) -> BatchLayout:
    n = len(batch.req_ids)
    ids = batch.req_ids
    return BatchLayout(
        req_ids=None if ids == prev_ids else list(ids),
        query_start_loc=batch.query_start_loc_np[: n + 1].tolist(),
        num_computed_tokens=batch.num_computed_tokens_np[:n].tolist(),
        prefill_lens=batch.prefill_len_np[:n].tolist(),
    )


def hidden_arena_size(max_num_tokens: int, hidden_size: int, itemsize: int, slots: int) -> int:
    from proto.arena import align_up

    return align_up(max_num_tokens * hidden_size * itemsize) * slots + 64 * slots
