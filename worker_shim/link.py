"""Per-step traffic between one runner and its sidecar.

The runner mixin calls `begin_step` / `pre_forward` / `end_step`; this class
decides which messages a step needs (from the sidecar's declared needs), moves
tensors through the arenas and keeps the counters tests and `status` compare.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import msgspec
import torch

from proto.arena import ShmArena, SlotRing, align_up
from proto.messages import BatchLayout, HookNeeds, NewRequest, StepBegin, StepEnd, StepPlan, Welcome
from proto.tensors import TENSOR_MARKER, TensorRef
from worker_shim.channel import SidecarChannel
from worker_shim.tensors import arena_tensor, dtype_name

log = logging.getLogger("vllm.omni_sidecar.shim.link")
PAYLOAD_KEY = "omni_sidecar"


class SidecarLink:
    def __init__(
        self,
        channel: SidecarChannel,
        welcome: Welcome,
        hidden_arena: ShmArena | None,
        hidden_slots: int,
    ) -> None:
        self.channel = channel
        self.needs: HookNeeds = welcome.needs
        self.hook_set = welcome.hook_set
        self.hidden_arena = hidden_arena
        self.ring = SlotRing(hidden_arena.size, hidden_slots) if hidden_arena else None
        self.overlay_arena = ShmArena.attach(welcome.arenas[0]) if welcome.arenas else None
        self.step = 0
        self.in_step = False
        self._new: list[NewRequest] = []
        self._finished: list[str] = []
        self._preempted: list[str] = []
        self._payload_reqs: set[str] = set()  # requests that carry a sidecar payload
        self._layout_sent = False
        self._sent_req_ids: list[str] | None = None  # what the sidecar last saw
        # Counters (read through the worker's `omni_sidecar_stats`).
        self.steps = 0
        self.new_requests = 0
        self.finished_requests = 0
        self.scheduled_tokens = 0
        self.blocking_exchanges = 0
        self.request_errors: dict[str, str] = {}
        self.exchange_us: list[float] = []  # blocking StepBegin round trips
        self.post_us: list[float] = []  # shim-side cost of each StepEnd (copy + send)
        self._step_exchange_us = 0.0
        self._last_post_us = 0.0  # reported on the next StepEnd (measured after sending)

    # -- notes from upstream calls ----------------------------------------------

    def note_finished(self, finished: set[str], preempted: set[str] | None) -> None:
        """vLLM frees both kinds in finish_requests; the sidecar keeps state for preempted ones."""
        if finished:
            self._finished.extend(sorted(finished))
            self.finished_requests += len(finished)
            self._payload_reqs.difference_update(finished)
        if preempted:
            self._preempted.extend(sorted(preempted))

    def note_new(self, new_reqs: list[Any]) -> None:
        for req in new_reqs:
            sp = req.sampling_params
            extra = (sp.extra_args or {}) if sp is not None else {}
            payload = extra.get(PAYLOAD_KEY)
            if isinstance(payload, dict):
                self._payload_reqs.add(req.req_id)
            self._new.append(
                NewRequest(
                    req_id=req.req_id,
                    prompt_len=int(req.prompt_len),
                    prompt_token_ids=list(req.prompt_token_ids or []),
                    payload=payload if isinstance(payload, dict) else None,
                )
            )
        self.new_requests += len(new_reqs)

    # -- the step ---------------------------------------------------------------

    def begin_step(self) -> None:
        self.in_step = True
        self._layout_sent = False

    def needs_exchange(self, input_batch: Any) -> bool:
        """Does any scheduled request need the sidecar before this forward?"""
        mode = self.needs.pre_forward
        if mode == "never":
            return False
        if self.needs.pre_forward_scope == "all":
            return mode == "always" or bool(input_batch.has_prefill)
        if not self._payload_reqs:
            return False
        ids = input_batch.req_ids
        if mode == "always":
            return any(r in self._payload_reqs for r in ids)
        prefilling = input_batch.is_prefilling_np
        return any(prefilling[i] and r in self._payload_reqs for i, r in enumerate(ids))

    def pre_forward(self, input_batch: Any, model: Any) -> dict[str, Any]:
        """Blocking StepBegin when the hooks need it; returns extra model inputs."""
        if not self.needs_exchange(input_batch):
            return {}
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
        plan: StepPlan = self.channel.call(msg, StepPlan)  # type: ignore[assignment]
        self.blocking_exchanges += 1
        self._record_errors(plan.errors)
        extra: dict[str, Any] = {}
        if plan.extra_kwargs:
            device = model_device(model)
            extra = {k: self._decode_kwarg(v, device, 0) for k, v in plan.extra_kwargs.items()}
        if plan.overlays:
            extra["inputs_embeds"] = self._overlay(plan, input_batch, model)
        self._step_exchange_us = (time.perf_counter() - t0) * 1e6
        self.exchange_us.append(self._step_exchange_us)
        return extra

    def end_step(self, state: Any) -> None:
        """After upstream execute_model: StepEnd with what the sidecar has not seen yet."""
        self.in_step = False
        t0 = time.perf_counter()
        batch = state.input_batch if state is not None else None
        if batch is None and not (self._new or self._finished or self._preempted):
            return
        hidden_ref = None
        num_tokens = 0
        if batch is not None:
            num_tokens = int(batch.num_tokens)
            self.steps += 1
            self.scheduled_tokens += num_tokens
            if self.needs.hidden_states and state.hidden_states is not None:
                hidden_ref = self._write_hidden(state.hidden_states[:num_tokens])
        msg = StepEnd(
            step=self.step,
            batch=None if (batch is None or self._layout_sent) else self._next_layout(batch),
            new_requests=self._new,
            finished=self._finished,
            preempted=self._preempted,
            hidden=hidden_ref,
            num_tokens=num_tokens,
            shim_exchange_us=self._step_exchange_us,
            shim_post_us=self._last_post_us,
        )
        self._step_exchange_us = 0.0
        self._new, self._finished, self._preempted = [], [], []
        self.channel.send(msg)
        if self.ring is not None and hidden_ref is not None:
            self.ring.owner_step[self.ring.slot_of(self.step)] = self.step
        self.step += 1
        for result in self.channel.take_results():
            self._record_errors(result.errors)
        if batch is not None:
            self._last_post_us = (time.perf_counter() - t0) * 1e6
            self.post_us.append(self._last_post_us)

    def _next_layout(self, batch: Any) -> BatchLayout:
        layout = _layout(batch, self._sent_req_ids)
        if layout.req_ids is not None:
            self._sent_req_ids = layout.req_ids
        return layout

    # -- tensors ------------------------------------------------------------------

    def _write_hidden(self, hidden: torch.Tensor) -> TensorRef:
        assert self.ring is not None and self.hidden_arena is not None
        slot = self.ring.slot_of(self.step)
        owner = self.ring.owner_step[slot]
        if owner is not None:
            # The sidecar may still be reading this slot: wait for that step's result.
            for result in self.channel.take_results(until_step=owner):
                self._record_errors(result.errors)
            self.ring.owner_step[slot] = None
        nbytes = hidden.numel() * hidden.element_size()
        if nbytes > self.ring.slot_size:
            raise RuntimeError(
                f"hidden states of {nbytes} bytes exceed the arena slot of {self.ring.slot_size}"
            )
        ref = TensorRef(0, self.ring.offset(slot), nbytes, list(hidden.shape), dtype_name(hidden.dtype))
        arena_tensor(self.hidden_arena, ref).copy_(hidden)
        return ref

    def _overlay(self, plan: StepPlan, input_batch: Any, model: Any) -> torch.Tensor:
        assert self.overlay_arena is not None, "sidecar sent overlays but offered no arena"
        n = int(input_batch.num_tokens_after_padding)
        embeds = model.embed_input_ids(input_batch.input_ids[:n])
        for ov in plan.overlays:
            rows = arena_tensor(self.overlay_arena, ov.rows)
            end = ov.row_start + rows.shape[0]
            if end > int(input_batch.num_tokens) or rows.dim() != 2 or rows.shape[1] != embeds.shape[1]:
                raise RuntimeError(
                    f"overlay rows [{ov.row_start}, {end}) x {list(rows.shape)} do not fit the "
                    f"batch of {input_batch.num_tokens} tokens x {embeds.shape[1]}"
                )
            embeds[ov.row_start : end].copy_(rows.to(device=embeds.device, dtype=embeds.dtype))
        return embeds

    def _decode_kwarg(self, value: Any, device: torch.device, depth: int) -> Any:
        """Tensor markers become tensors (copied out of the arena onto the model's device)."""
        if depth > 8:
            raise RuntimeError("sidecar extra kwargs nest deeper than 8 levels")
        if isinstance(value, dict):
            if TENSOR_MARKER in value:
                if self.overlay_arena is None:
                    raise RuntimeError("sidecar sent tensor kwargs but offered no arena")
                ref = msgspec.convert(value[TENSOR_MARKER], TensorRef)
                return arena_tensor(self.overlay_arena, ref).to(device, copy=True)
            return {k: self._decode_kwarg(v, device, depth + 1) for k, v in value.items()}
        if isinstance(value, list):
            return [self._decode_kwarg(v, device, depth + 1) for v in value]
        return value

    def _record_errors(self, errors: list[Any]) -> None:
        for err in errors:
            if err.req_id not in self.request_errors:
                log.error("omni-sidecar hook error for request %s: %s", err.req_id, err.message)
            self.request_errors[err.req_id] = err.message

    def stats(self) -> dict[str, Any]:
        self.flush()
        return {
            "hook_set": self.hook_set,
            "steps": self.steps,
            "new_requests": self.new_requests,
            "finished_requests": self.finished_requests,
            "scheduled_tokens": self.scheduled_tokens,
            "blocking_exchanges": self.blocking_exchanges,
            "request_errors": dict(self.request_errors),
            "exchange_us": list(self.exchange_us),
            "post_us": list(self.post_us),
        }

    def flush(self) -> None:
        """Wait for the results of every step sent so far."""
        if self.step:
            for result in self.channel.take_results(until_step=self.step - 1):
                self._record_errors(result.errors)

    def close(self) -> None:
        self.channel.close()
        for arena in (self.hidden_arena, self.overlay_arena):
            if arena is not None:
                arena.close()


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
        prompt_lens=batch.prefill_len_np[:n].tolist(),
    )


def hidden_arena_size(max_num_tokens: int, hidden_size: int, itemsize: int, slots: int) -> int:
    return align_up(max_num_tokens * hidden_size * itemsize) * slots + 64 * slots
