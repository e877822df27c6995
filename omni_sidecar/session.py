"""One shim connection: its arenas, its requests, and the hook calls per step."""

from __future__ import annotations

import logging
import time
from typing import Any

import msgspec
import torch

from omni_sidecar.hooks import HookErrors, OmniHooks, RequestInfo, StepBatch
from omni_sidecar.metrics import SidecarMetrics
from omni_sidecar.stats import LatencyWindow
from omni_sidecar.store import FinishedEntry, FinishedOutputs, client_request_id
from omni_arena.views import arena_tensor, torch_dtype
from omni_sidecar.tensors import write_tensor
from proto.arena import ArenaError, ShmArena, align_up
from proto.messages import (
    BatchLayout,
    Hello,
    NewRequest,
    Overlay,
    RequestError,
    SessionStatus,
    StepBegin,
    StepEnd,
    StepPlan,
    StepResult,
)
from proto.tensors import DTYPE_ITEMSIZE, TENSOR_MARKER

log = logging.getLogger("omni_sidecar.session")
MAX_KWARGS_DEPTH = 8


class OutArena:
    """The sidecar->shim arena, filled from offset 0 for each plan.

    Safe to reuse per step: the shim copies everything out of it before it
    sends the next message. On a CUDA IPC arena the copies are only enqueued
    then, so `reset` makes our stream wait on the shim's done event first and
    `seal` records the ready event the shim's stream waits on.
    """

    def __init__(self, arena: Any) -> None:
        self.arena = arena
        self.offset = 0
        self.device = not isinstance(arena, ShmArena)

    def reset(self) -> None:
        if self.device and self.offset:
            self.arena.wait_done(0)
        self.offset = 0

    def put(self, tensor: torch.Tensor):
        nbytes = tensor.numel() * tensor.element_size()
        if self.offset + nbytes > self.arena.size:
            raise ArenaError(
                f"step needs more than the {self.arena.size}-byte sidecar arena "
                "(raise it with --arena-mib)"
            )
        if self.device:
            ref = self.arena.write(self.offset, tensor.detach().to(self.arena.device))
        else:
            ref = write_tensor(self.arena, self.offset, tensor.detach().cpu().contiguous(), arena_id=0)
        self.offset = align_up(self.offset + max(nbytes, 1))
        return ref

    def seal(self) -> int:
        """The event index the shim waits on (-1: nothing written, or host memory)."""
        if not self.device or not self.offset:
            return -1
        return self.arena.mark_ready(0)


class Session:
    def __init__(
        self,
        session_id: int,
        hello: Hello,
        hooks: OmniHooks,
        finished: FinishedOutputs,
        arena_bytes: int = 0,
        metrics: SidecarMetrics | None = None,
    ) -> None:
        self.id = session_id
        self.hello = hello
        self.hooks = hooks
        self.finished_store = finished
        self.arena_bytes = arena_bytes
        self.metrics = metrics or SidecarMetrics()
        self.connected_at = time.monotonic()
        self.requests: dict[str, RequestInfo] = {}
        self.errors_by_request: dict[str, str] = {}
        self.in_arenas: list[Any] = []  # ShmArena or CudaIpcArena
        self.out: OutArena | None = None
        self.opens: Any = None  # CUDA IPC OpenCounts
        self.consumer_events: list[bytes] = []
        self.steps = 0
        self.new_requests = 0
        self.finished_requests = 0
        self.scheduled_tokens = 0
        self.errors = 0
        self.latency = LatencyWindow()
        self._aliases: dict[str, str] = {}
        self._begin_us = 0.0
        self._last_layout: BatchLayout | None = None
        self._prev_req_ids: list[str] | None = None

    # -- set-up --------------------------------------------------------------

    def open_arenas(self) -> None:
        """Map the shim's arenas; create ours for overlay rows / kwargs if the hooks need one.

        CUDA IPC: each device buffer and event is opened here, once per connection
        (`opens` counts them); our done events for the shim's slots go back in the Welcome.
        """
        for info in self.hello.arenas:
            if info.kind == "cuda_ipc":
                from omni_arena.cuda_ipc import CudaIpcArena, OpenCounts

                self.opens = self.opens or OpenCounts()
                arena = CudaIpcArena.attach(info, self.opens)
                self.consumer_events = arena.make_done_events()
                self.in_arenas.append(arena)
            else:
                self.in_arenas.append(ShmArena.attach(info))
        if self.hooks.needs.pre_forward != "never":
            if self.hello.dtype not in DTYPE_ITEMSIZE:
                raise ArenaError(f"shim announced unknown dtype {self.hello.dtype!r}")
            itemsize = DTYPE_ITEMSIZE[self.hello.dtype]
            rows_bytes = self.hello.max_num_tokens * self.hello.hidden_size * itemsize
            # Slack for per-tensor alignment; hook sets with big kwargs ask for more.
            size = max(align_up(max(1, rows_bytes)) + (1 << 20), self.arena_bytes)
            self.out = OutArena(self._create_out_arena(size))
            self.metrics.arena_bytes.labels("sidecar_to_shim").inc(size)
        self.metrics.arena_bytes.labels("shim_to_sidecar").inc(sum(a.size for a in self.in_arenas))

    def _create_out_arena(self, size: int) -> Any:
        """Same kind as the shim's: device memory when the shim offered CUDA IPC."""
        device_in = [a for a in self.in_arenas if not isinstance(a, ShmArena)]
        if not device_in:
            return ShmArena.create(size, prefix=f"omni-sidecar-s{self.id}")
        from omni_arena.cuda_ipc import CudaIpcArena

        arena = CudaIpcArena.create(size, device_in[0].device, 1, name=f"omni-sidecar-s{self.id}")
        arena.open_peer_done(list(self.hello.consumer_events), self.opens)
        return arena

    @property
    def out_arena(self) -> Any:
        return self.out.arena if self.out is not None else None

    def close(self) -> None:
        for arena in self.in_arenas:
            self.metrics.arena_bytes.labels("shim_to_sidecar").dec(arena.size)
            arena.close()
        if self.out is not None:
            self.metrics.arena_bytes.labels("sidecar_to_shim").dec(self.out.arena.size)
            self.out.arena.close()
        self.in_arenas.clear()
        self.out = None

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
        return {
            "requests": {r: [i.prompt_len, i.prompt_token_ids, i.payload] for r, i in self.requests.items()},
            "errors": dict(self.errors_by_request),
            "counters": [self.steps, self.new_requests, self.finished_requests, self.scheduled_tokens,
                         self.errors],
        }

    def import_(self, doc: dict[str, Any]) -> None:
        for req_id, (prompt_len, ids, payload) in doc.get("requests", {}).items():
            self.requests[req_id] = RequestInfo(req_id, prompt_len, ids, payload)
            client_id = client_request_id(req_id)
            if client_id is not None:
                self._aliases[client_id] = req_id
        self.errors_by_request.update(doc.get("errors", {}))
        (self.steps, self.new_requests, self.finished_requests, self.scheduled_tokens,
         self.errors) = doc.get("counters", [0, 0, 0, 0, 0])

    def resolve(self, req_id: str) -> str | None:
        """The live request a client id names (its own id or vLLM's internal one)."""
        if req_id in self.requests:
            return req_id
        return self._aliases.get(req_id)

    # -- per step ------------------------------------------------------------

    def step_begin(self, msg: StepBegin) -> StepPlan:
        t0 = time.perf_counter()
        errors: dict[str, str] = {}
        self._admit(msg.new_requests, msg.finished, msg.preempted, errors)
        layout = self._resolve_layout(msg.batch)
        batch = self._batch(msg.step, layout)
        self._last_layout = layout
        overlays: list[Overlay] = []
        extra: dict[str, Any] = {}
        if self.out is not None:
            self.out.reset()
        with _collect(errors, batch, "pre-forward hooks"):
            overlays = self._write_overlays(self.hooks.prepare_prefill_embeds(batch))
            extra = self._encode_kwargs(self.hooks.build_extra_kwargs(batch), 0)
        event = self.out.seal() if self.out is not None else -1
        self._begin_us = (time.perf_counter() - t0) * 1e6
        return StepPlan(step=msg.step, overlays=overlays, extra_kwargs=extra, errors=self._report(errors),
                        event=event)

    def step_end(self, msg: StepEnd) -> StepResult:
        t0 = time.perf_counter()
        errors: dict[str, str] = {}
        for failure in msg.failed:  # failed by the shim while no sidecar served them
            self.errors_by_request.setdefault(failure.req_id, failure.message)
        self._admit(msg.new_requests, [], msg.preempted, errors)
        layout = self._resolve_layout(msg.batch) if msg.batch is not None else self._last_layout
        if msg.num_tokens and layout is not None:
            self.steps += 1
            self.scheduled_tokens += msg.num_tokens
            batch = self._batch(msg.step, layout)
            with _collect(errors, batch, "process_model_output"):
                self.hooks.process_model_output(batch, self._hidden(msg))
            self._release_hidden(msg)
        self._last_layout = None
        result_errors = self._report(errors)
        self._finish(msg.finished)
        hook_us = (time.perf_counter() - t0) * 1e6 + self._begin_us
        self._begin_us = 0.0
        if msg.num_tokens:
            self.latency.record(hook_us)
            m = self.metrics
            m.steps.inc()
            m.tokens.inc(msg.num_tokens)
            m.step_hook_seconds.observe(hook_us * 1e-6)
            if msg.shim_exchange_us:
                m.shim_exchange_seconds.observe(msg.shim_exchange_us * 1e-6)
            if msg.shim_post_us:
                m.shim_post_seconds.observe(msg.shim_post_us * 1e-6)
            m.arena_used_bytes.labels("shim_to_sidecar").set(msg.hidden.nbytes if msg.hidden else 0)
            if self.out is not None:
                m.arena_used_bytes.labels("sidecar_to_shim").set(self.out.offset)
        return StepResult(step=msg.step, errors=result_errors, hook_us=hook_us)

    def _admit(
        self, new: list[NewRequest], finished: list[str], preempted: list[str], errors: dict[str, str]
    ) -> None:
        self._finish(finished)
        if preempted:
            self.metrics.requests.labels("preempted").inc(len(preempted))
            with _collect(errors, None, "on_preempted", preempted):
                self.hooks.on_preempted(list(preempted))
        if not new:
            return
        infos = []
        for req in new:
            info = RequestInfo(req.req_id, req.prompt_len, req.prompt_token_ids, req.payload)
            self.requests[req.req_id] = info
            client_id = client_request_id(req.req_id)
            if client_id is not None:
                self._aliases[client_id] = req.req_id
            infos.append(info)
        self.new_requests += len(new)
        self.metrics.requests.labels("new").inc(len(new))
        with _collect(errors, None, "on_new_requests", [r.req_id for r in new]):
            self.hooks.on_new_requests(infos)

    def _report(self, errors: dict[str, str]) -> list[RequestError]:
        for req_id, message in errors.items():
            self.errors_by_request.setdefault(req_id, message)
        self.errors += len(errors)
        if errors:
            self.metrics.request_errors.inc(len(errors))
        return [RequestError(r, m[:4000]) for r, m in errors.items()]

    def _finish(self, req_ids: list[str]) -> None:
        if not req_ids:
            return
        for req_id in req_ids:
            entry = FinishedEntry(
                outputs=self.hooks.get_outputs(req_id),
                chunks=self.hooks.output_chunks(req_id),
                error=self.errors_by_request.pop(req_id, ""),
            )
            if entry.outputs is not None or entry.chunks is not None or entry.error:
                if entry.error:
                    entry.outputs = entry.chunks = None  # never hand out partial outputs as complete
                self.finished_store.put(req_id, entry)
            if self.requests.pop(req_id, None) is not None:
                self.finished_requests += 1
                self.metrics.requests.labels("finished").inc()
            client_id = client_request_id(req_id)
            if client_id is not None and self._aliases.get(client_id) == req_id:
                del self._aliases[client_id]
        try:
            self.hooks.on_finished(list(req_ids))
        except Exception:
            log.exception("on_finished raised; the requests are gone from vLLM anyway")

    def _resolve_layout(self, layout: BatchLayout) -> BatchLayout:
        """Fill in `req_ids` omitted because they equal the previous layout's."""
        if layout.req_ids is None:
            if self._prev_req_ids is None:
                raise ValueError("batch layout omits req_ids but no earlier layout named them")
            return msgspec.structs.replace(layout, req_ids=self._prev_req_ids)
        self._prev_req_ids = layout.req_ids
        return layout

    def _batch(self, step: int, layout: BatchLayout) -> StepBatch:
        n = len(layout.req_ids)
        if not (
            len(layout.query_start_loc) == n + 1
            and len(layout.num_computed_tokens) == n
            and len(layout.prefill_lens) == n
        ):
            raise ValueError("batch layout lists have inconsistent lengths")
        return StepBatch(step, layout, self.requests)

    def _hidden(self, msg: StepEnd) -> torch.Tensor | None:
        if msg.hidden is None:
            return None
        if msg.hidden.arena >= len(self.in_arenas):
            raise ArenaError(f"hidden states name arena {msg.hidden.arena}, which was never offered")
        arena = self.in_arenas[msg.hidden.arena]
        if not isinstance(arena, ShmArena):
            arena.wait_ready(msg.hidden_event)  # the shim's copy, ordered on our stream
        return arena_tensor(arena, msg.hidden)

    def _release_hidden(self, msg: StepEnd) -> None:
        """CUDA IPC: the shim may rewrite the slot once the reads we enqueued ran."""
        if msg.hidden is not None and msg.hidden_event >= 0 and msg.hidden.arena < len(self.in_arenas):
            arena = self.in_arenas[msg.hidden.arena]
            if not isinstance(arena, ShmArena):
                arena.mark_done(msg.hidden_event)

    def _write_overlays(self, pairs: list[tuple[int, torch.Tensor]]) -> list[Overlay]:
        if not pairs:
            return []
        if self.out is None:
            raise RuntimeError("hook set returned overlay rows but declared pre_forward='never'")
        want = torch_dtype(self.hello.dtype)
        return [Overlay(row_start, self.out.put(rows.to(want))) for row_start, rows in pairs]

    def _encode_kwargs(self, value: Any, depth: int) -> Any:
        """Tensors in extra kwargs go into the arena; the message carries their refs."""
        if depth > MAX_KWARGS_DEPTH:
            raise ValueError(f"extra kwargs nest deeper than {MAX_KWARGS_DEPTH} levels")
        if isinstance(value, torch.Tensor):
            if self.out is None:
                raise RuntimeError("extra kwargs hold tensors but the hook set has no arena")
            return {TENSOR_MARKER: self.out.put(value)}
        if isinstance(value, dict):
            return {k: self._encode_kwargs(v, depth + 1) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [self._encode_kwargs(v, depth + 1) for v in value]
        return value

    def status(self) -> SessionStatus:
        p50, p99 = self.latency.summary()
        h = self.hello
        return SessionStatus(
            session=self.id,
            rank=h.rank,
            world_size=h.world_size,
            vllm_version=h.vllm_version,
            platform=h.platform,
            model=h.model,
            connected_s=time.monotonic() - self.connected_at,
            steps=self.steps,
            new_requests=self.new_requests,
            finished_requests=self.finished_requests,
            scheduled_tokens=self.scheduled_tokens,
            errors=self.errors,
            step_latency_us_p50=p50,
            step_latency_us_p99=p99,
            arena_opens=self.opens.mem if self.opens is not None else 0,
            event_opens=self.opens.events if self.opens is not None else 0,
        )


class _collect:
    """Turns hook exceptions into per-request errors; a hook bug never escapes."""

    def __init__(self, errors: dict[str, str], batch: StepBatch | None, where: str,
                 req_ids: list[str] | None = None) -> None:
        self.errors = errors
        self.where = where
        self.req_ids = req_ids if req_ids is not None else (batch.req_ids if batch else [])

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc is None:
            return False
        if isinstance(exc, HookErrors):
            for req_id, message in exc.errors.items():
                self.errors.setdefault(req_id, message)
            return True
        if isinstance(exc, Exception):
            log.error("%s raised %r", self.where, exc, exc_info=(exc_type, exc, tb))
            for req_id in self.req_ids:
                self.errors.setdefault(req_id, f"{self.where}: {exc!r}")
            return True
        return False
