"""The `omni` hook set: vllm-omni's runner hooks, running in the sidecar.

Per request it decodes the payload (`prompt_embeds`, vllm-omni
`additional_information`, or a plain `model_intermediate_buffer`) into state,
overlays prompt embeddings in prefill (chunk-aware), optionally hands the model
`runtime_additional_information` and `request_token_spans` as forward kwargs,
runs a per-request `postprocess` over each step's hidden-state rows (its update
is merged into state and visible on the next step), and assembles multimodal
outputs per request for clients (streamed per step, complete at finish).

Subclass it for a model: override `postprocess`, `multimodal_outputs` or
`runtime_info`. Options (`--hook-option key=value`): extra_kwargs=1,
state_cap_mib=N, resident_keys=cat.qual,cat.qual (state entries kept on the device; default
hidden_states.last, as vllm-omni's talkers declare it; `resident_keys=` for none), hidden_layers=0,24 (each
request's outputs then hold those decoder layers' hidden states, token aligned,
as `hidden_states.layer_N`: vllm-omni's `hidden_states["layers"][N]` once
unflattened, omni/keys.py), plan_ahead=0 (never build a steady decode step's plan
before its StepBegin comes: omni_sidecar/sessions/plan_ahead.py), replace_appends=1
(an appended payload replaces the request's state instead of merging into it,
keeping `meta.num_processed_tokens` and `meta.resumable`: what vllm-omni's runner
does for a model that declares `replace_runtime_additional_information`, e.g.
MiniCPM-o's code2wav; not for a model whose state the shim mirrors).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from omni_sidecar.hook_sets.reference import check_prompt_embeds, overlay_rows
from omni_sidecar.hook_api.hook_set import HookErrors, OmniHooks, RequestHookError, RequestInfo, StepBatch
from omni_sidecar.hook_sets.omni.keys import layer_key
from omni_sidecar.hook_sets.omni.outputs import OutputLog, accumulate, dotted_outputs, own_copy, slice_per_request
from omni_sidecar.hook_sets.omni.state import IntermediateBuffer, StateError
from omni_sidecar.hook_sets.omni.wire import (
    PayloadError,
    decode_additional_information,
    decode_plain_buffer,
    decode_tensor_spec,
)
from proto.messages import HookNeeds

_TRUE = {"1", "true", "yes", "on"}
# The default postprocess writes each request's last hidden row every step, and the next plan sends
# it back to the model's device: kept on the host, it would be a device-to-host copy a step, and that
# copy waits for the step's forward (a synchronize before every plan, which would also keep the shim
# from running ahead of the GPU). vllm-omni's talkers declare this key GPU-resident alike.
DEFAULT_RESIDENT_KEYS = "hidden_states.last"


class OmniStateHooks(OmniHooks):
    name = "omni"
    state_version = "omni/1"
    accepts_state = ("omni/1",)
    # A payload's `embed.prefill` overlays the prompt's embeddings (it must be [prompt_len, hidden]).
    prefill_overlays_prompt = True

    def __init__(
        self, extra_kwargs: str = "0", state_cap_mib: str = "256", resident_keys: str = DEFAULT_RESIDENT_KEYS,
        hidden_layers: str = "", plan_ahead: str = "1", replace_appends: str = "0",
    ) -> None:
        self.send_extra_kwargs = str(extra_kwargs).lower() in _TRUE
        self.replace_appends = str(replace_appends).lower() in _TRUE
        # This set's plans are pure (they read the batch and the state); a subclass that overrides
        # how they are built plans ahead only if it says so (`plans_ahead = True` on its class).
        cls = type(self)
        own = all(getattr(cls, m) is getattr(OmniStateHooks, m)
                  for m in ("prepare_prefill_embeds", "build_extra_kwargs", "runtime_info"))
        self.plans_ahead = str(plan_ahead).lower() in _TRUE and (own or cls.plans_ahead)
        resident = {tuple(k.strip().split(".", 1)) for k in resident_keys.split(",") if "." in k}
        self.state = IntermediateBuffer(
            resident_keys=resident,  # type: ignore[arg-type]
            max_bytes_per_request=int(float(state_cap_mib) * (1 << 20)),
        )
        self.prompt_embeds: dict[str, torch.Tensor] = {}
        self.log = OutputLog()
        self.preempted: set[str] = set()
        self._row_views: set[str] = set()  # requests whose state rows view the last batched step's gather
        self.needs = HookNeeds(
            pre_forward="always" if self.send_extra_kwargs else "prefill",
            pre_forward_scope="all" if self.send_extra_kwargs else "payload",
            hidden_states=True,
            prefix_cache_safe=False,
            model_states=True,
            hidden_layers=sorted({int(n) for n in hidden_layers.split(",") if n.strip()}),
            extra_kwargs=self.send_extra_kwargs,
        )

    # -- model-specific parts (override) -----------------------------------------

    def postprocess(
        self, req_id: str, hidden_rows: torch.Tensor, state: dict[str, Any]
    ) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
        """Per request and step: (state update, per-request outputs for this step).

        Default: counts processed tokens, keeps the last hidden row, and emits a
        `processed_trace` row (tokens processed before this step, rows this step).
        """
        before = int(state.get("meta", {}).get("num_processed_tokens", 0))
        n = int(hidden_rows.shape[0])
        update = {
            "meta": {"num_processed_tokens": before + n},
            "hidden_states": {"last": hidden_rows[-1:].clone()},
        }
        return update, {"processed_trace": torch.tensor([[before, n]], dtype=torch.int64)}

    def multimodal_outputs(self, batch: StepBatch, hidden: torch.Tensor) -> dict[str, Any]:
        """Batch-level outputs (token-aligned tensors, per-request lists). Default: hidden states."""
        return {"hidden_states": hidden}

    def runtime_info(self, req_id: str, state: dict[str, Any]) -> dict[str, Any]:
        """What the model's forward gets for this request in runtime_additional_information."""
        return state

    # -- hook API -----------------------------------------------------------------

    def on_new_requests(self, requests: list[RequestInfo]) -> None:
        errors = {}
        for req in requests:
            if req.req_id in self.preempted:
                # Resumed after preemption: keep state and outputs (policy in omni/state.py).
                self.preempted.discard(req.req_id)
                continue
            try:
                initial, embeds = self._decode_payload(req)
                self.state.free(req.req_id)
                self.state.create(req.req_id, initial)
                self.state.merge(req.req_id, {"meta": {"prompt_len": req.prompt_len}})
                if embeds is not None:
                    self.prompt_embeds[req.req_id] = check_prompt_embeds(embeds, req.prompt_len)
                self.log.start(req.req_id)
            except (PayloadError, StateError) as exc:
                errors[req.req_id] = str(exc)
        if errors:
            raise HookErrors(errors)

    def prepare_prefill_embeds(self, batch: StepBatch) -> list[tuple[int, torch.Tensor]]:
        return overlay_rows(batch, self.prompt_embeds)

    def build_extra_kwargs(self, batch: StepBatch) -> dict[str, Any]:
        if not self.send_extra_kwargs:
            return {}
        req_ids, qsl, states, info = batch.req_ids, batch.layout.query_start_loc, self.state.get, self.runtime_info
        infos = [info(r, states(r) or {}) for r in req_ids]
        spans = [[qsl[i], qsl[i + 1]] for i in range(len(req_ids))]  # batch.rows(i), without a call each
        return {"runtime_additional_information": infos, "request_token_spans": spans}

    def process_model_output(self, batch: StepBatch, hidden_states: torch.Tensor | None) -> None:
        if hidden_states is None:
            return
        layout = batch.layout
        n = len(layout.req_ids)
        layers = {layer_key(index): rows for index, rows in batch.hidden_layers.items()}
        # One copy per batch-level output, then per-request views of it: the rows sit in memory the
        # shim reuses, and a copy per request and output was a kernel each on GPU, every step.
        # A step's requests share its copy, as vllm-omni's share the step's host copy.
        owned = {name: own_copy(value) for name, value in {**self.multimodal_outputs(batch, hidden_states), **layers}.items()}
        batched = self._postprocess_batch(batch, hidden_states)
        if batched is not None:
            errors = self._apply_batched(batch, owned, *batched)
        else:
            errors = self._postprocess_each(batch, hidden_states, slice_per_request(owned, layout.query_start_loc, n))
        if errors:
            raise HookErrors(errors)

    def _postprocess_each(self, batch: StepBatch, hidden: torch.Tensor, per_req: list[dict[str, Any]]) -> dict[str, str]:
        """A subclass's `postprocess`, called per request; its update merged, its outputs logged."""
        errors = {}
        for i, req_id in enumerate(batch.layout.req_ids):
            state = self.state.get(req_id)
            if state is None:
                continue  # a request whose payload failed: already reported
            try:
                update, outputs = self.postprocess(req_id, hidden[slice(*batch.rows(i))], state)
                self.state.merge(req_id, update)
                # A resident key keeps what the override returned; a view of `hidden` (the shim's slot,
                # rewritten later) gets storage of its own.
                self.state.own_storage(req_id)
                chunk = per_req[i]
                if outputs:  # an override's outputs may alias the shim's rows
                    chunk.update({k: own_copy(v) for k, v in outputs.items()})
                self.log.add(req_id, chunk, batch.step, owned=True)
            except (StateError, PayloadError, ValueError) as exc:
                errors[req_id] = f"postprocess: {exc}"
        return errors

    def _apply_batched(self, batch: StepBatch, owned: dict[str, Any],
                       columns: dict[tuple[str, str], list[Any]],
                       rows: dict[str, Callable[[], torch.Tensor]]) -> dict[str, str]:
        """The default postprocess's columns merged (one pass, `merge_columns`); its outputs logged
        whole, cut per request when read (omni/outputs.py, `OutputLog`)."""
        req_ids = batch.layout.req_ids
        refused = self.state.merge_columns(req_ids, columns, placed=True)  # `_postprocess_batch` placed them
        # The rows each state now keeps are views of this step's gather; a request that leaves the
        # batch (preempted, finished, not scheduled) or was refused keeps its row in storage of its
        # own, so no state holds a whole past step alive (the cap counts what a state keeps).
        for req_id in self._row_views.difference(req_ids).union(refused):
            self.state.own_storage(req_id)
        self._row_views = set(req_ids).difference(refused)
        stateless = self.state.missing(req_ids)  # their payload failed: no outputs, as ever
        self.log.add_step(req_ids, owned, batch.layout.query_start_loc, rows, stateless.union(refused), batch.step)
        return {r: f"postprocess: {m}" for r, m in refused.items()}

    def between_steps(self) -> None:
        self.log.settle()

    def _postprocess_batch(self, batch: StepBatch, hidden: torch.Tensor
                           ) -> tuple[dict[tuple[str, str], list[Any]], dict[str, Callable[[], torch.Tensor]]] | None:
        """The default `postprocess` for all requests at once, as columns (one gather and one host
        copy a step, not a copy per request): the state columns `merge_columns` takes and the
        outputs, one row per request. None when a subclass overrides `postprocess` (it is then
        called per request) or a request has no rows this step."""
        if type(self).postprocess is not OmniStateHooks.postprocess:
            return None
        qsl = batch.layout.query_start_loc
        req_ids = batch.layout.req_ids
        n = len(req_ids)
        decode = qsl == list(range(n + 1))  # one row each, in order: one compare, not a check per request
        if not decode and any(qsl[i + 1] <= qsl[i] for i in range(n)):
            return None
        if not n:
            return {}, {}  # every row of the step was seen before (a replay): nothing to process
        if qsl[n] > hidden.shape[0]:  # the shim's layout is untrusted: an index past the rows is a device assert
            raise ValueError(f"the step's layout names {qsl[n]} rows, its hidden states hold {hidden.shape[0]}")
        if decode:  # the last rows are the first n, in order
            last = self.state.place("hidden_states", "last", hidden[:n])
            if last.data_ptr() == hidden.data_ptr():  # still the shim's memory (not moved to the host): copy
                last = last.clone()
        else:
            rows = torch.tensor([qsl[i + 1] - 1 for i in range(n)])
            # Up from pinned memory without waiting: a pageable copy to the device waits for the stream,
            # i.e. for the step's forward.
            rows = rows.pin_memory().to(hidden.device, non_blocking=True) if hidden.is_cuda else rows
            last = self.state.place("hidden_states", "last", hidden.index_select(0, rows))
        before = list(map(int, self.state.column(req_ids, "meta", "num_processed_tokens", 0)))
        counts = [1] * n if decode else [qsl[i + 1] - qsl[i] for i in range(n)]
        # `split` makes all the per-request views in one call, not a slice op each.
        columns = {("meta", "num_processed_tokens"): [b + c for b, c in zip(before, counts)],
                   ("hidden_states", "last"): list(last.split(1))}
        return columns, {"processed_trace": lambda: torch.tensor(list(zip(before, counts)), dtype=torch.int64)}

    def model_states(self, req_ids: list[str]) -> dict[str, dict[str, Any]]:
        """The decoded payload state of each request (those whose payload failed are already reported)."""
        return {r: state for r in req_ids if (state := self.state.get(r)) is not None}

    def on_model_results(self, updates: dict[str, dict[str, Any]], outputs: dict[str, dict[str, Any]]) -> None:
        """The model's updates merge into state (its rules); its outputs join the request's
        output log under dotted names ("codes.audio": [1, Q] per step -> [T, Q] assembled)."""
        errors = {}
        for req_id, update in updates.items():
            try:
                if not isinstance(update, dict):
                    raise StateError(f"model update is a {type(update).__name__}, not a dict")
                self.state.merge(req_id, update)
            except StateError as exc:
                errors[req_id] = f"model update: {exc}"
        for req_id, output in outputs.items():
            try:
                if req_id not in errors:
                    self.log.add(req_id, dotted_outputs(output), self.current_step)
            except ValueError as exc:
                errors[req_id] = f"model outputs: {exc}"
        if errors:
            raise HookErrors(errors)

    def on_payload_appended(self, req_id: str, payload: bytes) -> None:
        """Entries streamed into a running request (vllm-omni's "async chunk"): decoded like a prompt's
        additional_information and merged with the state rules (`embed.decode` spans in order, overlap
        trimmed, a gap refused), all or nothing; with `replace_appends`, in place of the state."""
        if self.state.get(req_id) is None:
            raise RequestHookError(req_id, "the request has no state to append to (its payload failed)")
        try:
            self.state.merge(req_id, decode_additional_information(payload), replace=self.replace_appends)
        except (PayloadError, StateError) as exc:
            raise RequestHookError(req_id, f"append refused: {exc}") from None

    def stage_mirrored_append(self, req_id: str, payload: bytes, earlier: list[dict[str, Any]]) -> dict[str, Any]:
        """As `on_payload_appended`, checked against the state plus the staged `earlier`; returns its delta
        (both sides then merge the same delta into the same state)."""
        if self.state.get(req_id) is None:
            raise RequestHookError(req_id, "the request has no state to append to (its payload failed)")
        if self.replace_appends:  # the shim's mirror takes deltas to merge, never a replacement
            raise RequestHookError(req_id, "append refused: replace_appends=1 cannot reach the state the shim "
                                           "mirrors for a model with its own hooks")
        try:
            return self.state.trial_merge(req_id, earlier, decode_additional_information(payload))
        except (PayloadError, StateError) as exc:
            raise RequestHookError(req_id, f"append refused: {exc}") from None

    def commit_mirrored_append(self, req_id: str, entries: dict[str, Any]) -> None:
        self.state.merge(req_id, entries)

    def get_outputs(self, req_id: str) -> dict[str, Any] | None:
        chunks = self.output_chunks(req_id)
        return accumulate(chunks) if chunks is not None else None

    def output_chunks(self, req_id: str) -> list[dict[str, Any]] | None:
        """The request's chunks; with async scheduling, those of its steps before the one the session
        handles last (that step's may yet be withdrawn: `on_discarded` comes with the next step)."""
        chunks = self.log.chunks(req_id)
        if chunks is None or not self.async_scheduling:
            return chunks
        return chunks[:self.log.before_step(req_id, self.current_step)]

    def deferred_outputs(self, req_id: str) -> Callable[[], tuple[dict[str, Any] | None, list[dict[str, Any]] | None]] | None:
        """The request's chunks, cut when read, and their accumulation: only where `get_outputs` and
        `output_chunks` are this set's own. The log is taken out here, before `on_finished`: a chunk
        an override's `on_finished` adds is not among them."""
        cls = type(self)
        if cls.get_outputs is not OmniStateHooks.get_outputs or cls.output_chunks is not OmniStateHooks.output_chunks:
            return None
        cut = self.log.detach(req_id)
        if cut is None:
            return None

        def made() -> tuple[dict[str, Any], list[dict[str, Any]]]:
            chunks = cut()
            return accumulate(chunks), chunks

        return made

    def on_discarded(self, steps: dict[str, int]) -> None:
        """The discarded step's outputs leave the request's log (its state goes with its finish)."""
        for req_id, step in steps.items():
            self.log.withdraw(req_id, step)

    def on_preempted(self, req_ids: list[str]) -> None:
        self.preempted.update(req_ids)

    def on_finished(self, req_ids: list[str]) -> None:
        for req_id in req_ids:
            self.state.free(req_id)
            self.prompt_embeds.pop(req_id, None)
            self.log.forget(req_id)
            self.preempted.discard(req_id)

    # -- hot upgrade ----------------------------------------------------------------

    def export_state(self) -> dict[str, Any]:
        return {
            "states": {r: self.state.get(r) for r in self.state.req_ids()},
            "prompt_embeds": dict(self.prompt_embeds),
            "chunks": self.log.export(),
            "preempted": sorted(self.preempted),
        }

    def import_state(self, state: dict[str, Any]) -> None:
        for req_id, value in state.get("states", {}).items():
            self.state.restore(req_id, value)
        self.prompt_embeds.update(state.get("prompt_embeds", {}))
        self.log.restore(state.get("chunks", {}))
        self.preempted.update(state.get("preempted", []))

    # -- payloads -----------------------------------------------------------------

    def _decode_payload(self, req: RequestInfo) -> tuple[dict[str, Any], torch.Tensor | None]:
        payload = req.payload or {}
        initial: dict[str, Any] = {}
        if "model_intermediate_buffer" in payload:
            buf = decode_plain_buffer(payload["model_intermediate_buffer"])
            if not isinstance(buf, dict):
                raise PayloadError("model_intermediate_buffer must be a dict")
            initial.update(buf)
        if "additional_information" in payload:
            info = decode_additional_information(payload["additional_information"])
            for key, value in info.items():
                if isinstance(value, dict) and isinstance(initial.get(key), dict):
                    initial[key] = {**initial[key], **value}
                else:
                    initial[key] = value
        embeds = None
        if "prompt_embeds" in payload:
            embeds = decode_tensor_spec(payload["prompt_embeds"], "prompt_embeds")
        elif (self.prefill_overlays_prompt and isinstance(initial.get("embed"), dict)
              and isinstance(initial["embed"].get("prefill"), torch.Tensor)):
            embeds = initial["embed"]["prefill"]
        return initial, embeds
