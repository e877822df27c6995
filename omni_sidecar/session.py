"""One shim connection: its arenas, its requests, and the hook calls per step."""

from __future__ import annotations

import logging
import time
from collections import OrderedDict

import torch

from omni_sidecar.hooks import OmniHooks, RequestHookError, RequestInfo, StepBatch
from omni_sidecar.stats import LatencyWindow
from omni_sidecar.tensors import torch_dtype, view_tensor, write_tensor
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
from proto.tensors import DTYPE_ITEMSIZE

log = logging.getLogger("omni_sidecar.session")


def client_request_id(req_id: str) -> str | None:
    """The id the client gave vLLM: vLLM appends "-<8 random chars>" internally."""
    if len(req_id) > 9 and req_id[-9] == "-":
        return req_id[:-9]
    return None


class FinishedOutputs:
    """Outputs of finished requests kept for clients, oldest dropped first.

    Found by vLLM's internal request id or by the client's own id.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._items: OrderedDict[str, dict[str, torch.Tensor]] = OrderedDict()
        self._alias: dict[str, str] = {}

    def put(self, req_id: str, outputs: dict[str, torch.Tensor]) -> None:
        self._items[req_id] = outputs
        self._items.move_to_end(req_id)
        client_id = client_request_id(req_id)
        if client_id is not None:
            self._alias[client_id] = req_id
        while len(self._items) > self.capacity:
            old, _ = self._items.popitem(last=False)
            old_client = client_request_id(old)
            if old_client is not None and self._alias.get(old_client) == old:
                del self._alias[old_client]

    def resolve(self, req_id: str) -> str:
        return req_id if req_id in self._items else self._alias.get(req_id, req_id)

    def get(self, req_id: str, pop: bool) -> dict[str, torch.Tensor] | None:
        key = self.resolve(req_id)
        return self._items.pop(key, None) if pop else self._items.get(key)


class Session:
    def __init__(
        self, session_id: int, hello: Hello, hooks: OmniHooks, finished: FinishedOutputs
    ) -> None:
        self.id = session_id
        self.hello = hello
        self.hooks = hooks
        self.finished_store = finished
        self.connected_at = time.monotonic()
        self.requests: dict[str, RequestInfo] = {}
        self._aliases: dict[str, str] = {}
        self.in_arenas: list[ShmArena] = []
        self.out_arena: ShmArena | None = None
        self.steps = 0
        self.new_requests = 0
        self.finished_requests = 0
        self.scheduled_tokens = 0
        self.errors = 0
        self.latency = LatencyWindow()
        self._begin_us = 0.0
        self._last_layout: BatchLayout | None = None

    # -- set-up --------------------------------------------------------------

    def open_arenas(self) -> None:
        """Map the shim's arenas; create ours for overlay rows if the hooks need one."""
        for info in self.hello.arenas:
            self.in_arenas.append(ShmArena.attach(info))
        if self.hooks.needs.pre_forward != "never":
            if self.hello.dtype not in DTYPE_ITEMSIZE:
                raise ArenaError(f"shim announced unknown dtype {self.hello.dtype!r}")
            itemsize = DTYPE_ITEMSIZE[self.hello.dtype]
            rows_bytes = self.hello.max_num_tokens * self.hello.hidden_size * itemsize
            # Slack for per-overlay alignment (one overlay per request at most).
            size = align_up(max(1, rows_bytes)) + 64 * 1024
            self.out_arena = ShmArena.create(size, prefix=f"omni-sidecar-s{self.id}")

    def close(self) -> None:
        for arena in self.in_arenas:
            arena.close()
        if self.out_arena is not None:
            self.out_arena.close()
        self.in_arenas.clear()
        self.out_arena = None

    def resolve(self, req_id: str) -> str | None:
        """The live request a client id names (its own id or vLLM's internal one)."""
        if req_id in self.requests:
            return req_id
        return self._aliases.get(req_id)

    # -- per step ------------------------------------------------------------

    def step_begin(self, msg: StepBegin) -> StepPlan:
        t0 = time.perf_counter()
        errors: list[RequestError] = []
        self._admit(msg.new_requests, msg.finished, errors)
        batch = self._batch(msg.step, msg.batch)
        self._last_layout = msg.batch
        overlays: list[Overlay] = []
        extra: dict = {}
        try:
            overlays = self._write_overlays(self.hooks.prepare_prefill_embeds(batch))
            extra = self.hooks.build_extra_kwargs(batch)
        except RequestHookError as exc:
            errors.append(RequestError(exc.req_id, str(exc)))
        except Exception as exc:  # a hook bug fails this step's requests, not the sidecar
            errors.extend(self._fail_all(batch, "pre-forward hooks", exc))
        self.errors += len(errors)
        self._begin_us = (time.perf_counter() - t0) * 1e6
        return StepPlan(step=msg.step, overlays=overlays, extra_kwargs=extra, errors=errors)

    def step_end(self, msg: StepEnd) -> StepResult:
        t0 = time.perf_counter()
        errors: list[RequestError] = []
        self._admit(msg.new_requests, [], errors)
        layout = msg.batch if msg.batch is not None else self._last_layout
        if msg.num_tokens and layout is not None:
            self.steps += 1
            self.scheduled_tokens += msg.num_tokens
            batch = self._batch(msg.step, layout)
            try:
                hidden = self._hidden(msg)
                self.hooks.process_model_output(batch, hidden)
            except RequestHookError as exc:
                errors.append(RequestError(exc.req_id, str(exc)))
            except Exception as exc:
                errors.extend(self._fail_all(batch, "process_model_output", exc))
        self._last_layout = None
        self._finish(msg.finished)
        self.errors += len(errors)
        hook_us = (time.perf_counter() - t0) * 1e6 + self._begin_us
        self._begin_us = 0.0
        if msg.num_tokens:
            self.latency.record(hook_us)
        return StepResult(step=msg.step, errors=errors, hook_us=hook_us)

    def _admit(
        self, new: list[NewRequest], finished: list[str], errors: list[RequestError]
    ) -> None:
        self._finish(finished)
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
        try:
            self.hooks.on_new_requests(infos)
        except RequestHookError as exc:
            errors.append(RequestError(exc.req_id, str(exc)))
        except Exception as exc:
            log.exception("on_new_requests failed")
            errors.extend(RequestError(r.req_id, f"on_new_requests: {exc!r}") for r in new)

    def _finish(self, req_ids: list[str]) -> None:
        if not req_ids:
            return
        for req_id in req_ids:
            outputs = self.hooks.get_outputs(req_id)
            if outputs is not None:
                self.finished_store.put(req_id, outputs)
            if self.requests.pop(req_id, None) is not None:
                self.finished_requests += 1
            client_id = client_request_id(req_id)
            if client_id is not None and self._aliases.get(client_id) == req_id:
                del self._aliases[client_id]
        self.hooks.on_finished(list(req_ids))

    def _batch(self, step: int, layout: BatchLayout) -> StepBatch:
        n = len(layout.req_ids)
        if not (
            len(layout.query_start_loc) == n + 1
            and len(layout.num_computed_tokens) == n
            and len(layout.prompt_lens) == n
        ):
            raise ValueError("batch layout lists have inconsistent lengths")
        reqs = [
            self.requests.get(r) or RequestInfo(r, layout.prompt_lens[i], [])
            for i, r in enumerate(layout.req_ids)
        ]
        return StepBatch(step, layout, reqs)

    def _hidden(self, msg: StepEnd) -> torch.Tensor | None:
        if msg.hidden is None:
            return None
        if msg.hidden.arena >= len(self.in_arenas):
            raise ArenaError(f"hidden states name arena {msg.hidden.arena}, which was never offered")
        return view_tensor(self.in_arenas[msg.hidden.arena], msg.hidden)

    def _write_overlays(self, pairs: list[tuple[int, torch.Tensor]]) -> list[Overlay]:
        if not pairs:
            return []
        if self.out_arena is None:
            raise RuntimeError("hook set returned overlay rows but declared pre_forward='never'")
        want = torch_dtype(self.hello.dtype)
        overlays, offset = [], 0
        for row_start, rows in pairs:
            rows = rows.to(want)
            ref = write_tensor(self.out_arena, offset, rows, arena_id=0)
            offset = align_up(offset + ref.nbytes)
            overlays.append(Overlay(row_start, ref))
        return overlays

    def _fail_all(self, batch: StepBatch, where: str, exc: Exception) -> list[RequestError]:
        log.exception("%s raised for step %d", where, batch.step)
        return [RequestError(r, f"{where}: {exc!r}") for r in batch.req_ids]

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
        )
