"""`omni-code2wav`: a generation-only stage (codes in, waveform out, no sampling) on V2 through the shim.

The shape of vllm-omni's code2wav stage (Qwen3-TTS, Qwen3-Omni): its model takes
`runtime_additional_information` per request, `codes.audio` (flat, codebook-major) and
`meta.left_context_size`, and returns one waveform per request in
`multimodal_outputs["model_outputs"]`, the left context's samples already cut off.

Upstream V2 samples a token for every scheduled request every step and knows no other
kind of request, so a code2wav request runs as a clock (docs/ARCHITECTURE.md,
"Generation-only stages"): one placeholder prompt token, `max_tokens` = its number of
chunks (`num_chunks`), `ignore_eos`; the model's logits make any token fine and no
sampled token is read. This hook set does the rest, with no weights:
- on admission, the request's payload (vllm-omni's `additional_information`) gives
  `codes.audio` [frames, Q] (the talker's assembled codes), optionally
  `meta.codec_chunk_frames` / `meta.initial_codec_chunk_frames` (a shorter first chunk, so the
  first audio comes sooner) / `meta.codec_left_context_frames` for this request, and
  `meta.codec_next_chunk`, the chunk it decodes first (0; omni-serve sends one request per
  chunk, each a window of the codes whose chunk k is the new one);
- before each forward (one blocking exchange per step with a code2wav request), each
  request's next chunk, frames [start - ctx, end) with ctx = min(left context, start).
  Step t of a request is the one whose last row is its position `prompt_len - 1 + t`;
  the chunk a step got is kept in the request's state with t, so a step seen again
  (recompute after preemption reaches a later position, never an earlier one) is never
  given a chunk twice;
- streamed codes (`meta.codec_streaming: true`, vllm-omni's async chunk): the talker's
  frames arrive while the request runs, as appends that replace `codes.audio` with the
  frames so far, and `meta.codec_final: true` once no more will come. A chunk is
  decoded once all its frames are there (or the codes are final); a step that finds
  the next chunk incomplete decodes nothing for that request, and the chunk goes to a
  later step. Such a request's clock (`max_tokens`) therefore needs room for the steps
  that waited: a driver that steps the stage only when each request's next chunk is
  there needs none; a request whose clock ends with chunks undecoded is reported in
  the log with how many;
- after it, the waveform chunks the model returned are kept per request as
  `waveform` [samples, 1] (concatenated across steps; streamed per step) and `sr`.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from omni_sidecar.hook_api.hook_set import HookErrors, RequestHookError, RequestInfo, StepBatch
from omni_sidecar.hook_sets.omni.state_hooks import OmniStateHooks
from proto.chunk_grid import ChunkGrid
from proto.messages import HookNeeds
from proto.settings import CODE2WAV_CHUNK_FRAMES, CODE2WAV_LEFT_CONTEXT_FRAMES

log = logging.getLogger("omni_sidecar.code2wav")
# Per-request bookkeeping in the state's meta (handed over with it in a hot upgrade).
STEP_SEEN, STEP_CHUNK, NEXT_CHUNK = "codec_step_seen", "codec_step_chunk", "codec_next_chunk"
WAVEFORM = "waveform"  # assembled output: [samples, 1] float32
MODEL_WAVEFORM = "model_outputs"  # vllm-omni's code2wav output key: one 1-dim waveform per request


def num_chunks(frames: int, chunk_frames: int, initial_chunk_frames: int = 0) -> int:
    """Chunks of a request of `frames` code frames: its `max_tokens` (one chunk per step)."""
    return ChunkGrid(chunk_frames, initial_chunk_frames).count(frames)


def chunk_span(k: int, frames: int, chunk_frames: int, left_context: int,
               initial_chunk_frames: int = 0) -> tuple[int, int, int] | None:
    """(first, start, end) of chunk k: frames [first, end) are decoded, [start, end) are new
    (first = start - min(left_context, start)); None past the last chunk or before the first."""
    return ChunkGrid(chunk_frames, initial_chunk_frames).span(k, frames, left_context)


def chunk_input(codes: torch.Tensor, k: int, chunk_frames: int, left_context: int,
                initial_chunk_frames: int = 0) -> dict[str, Any] | None:
    """Chunk k of codes [frames, Q] as the model's runtime info (vllm-omni's code2wav input)."""
    return grid_input(codes, k, ChunkGrid(chunk_frames, initial_chunk_frames), left_context)


def grid_input(codes: torch.Tensor, k: int, grid: ChunkGrid, left_context: int) -> dict[str, Any] | None:
    span = grid.span(k, int(codes.shape[0]), left_context)
    if span is None:
        return None
    first, start, end = span
    flat = codes[first:end].t().contiguous().reshape(-1)  # codebook-major [Q * (end - first)]
    return {"codes": {"audio": flat}, "meta": {"left_context_size": start - first}}


class Code2WavHooks(OmniStateHooks):
    name = "omni-code2wav"

    def __init__(self, chunk_frames: str = str(CODE2WAV_CHUNK_FRAMES),
                 left_context: str = str(CODE2WAV_LEFT_CONTEXT_FRAMES), state_cap_mib: str = "256",
                 codebook_size: str = "0", initial_chunk_frames: str = "0") -> None:
        super().__init__(state_cap_mib=state_cap_mib)
        self.chunk_frames = int(chunk_frames)
        # The first chunk's frames (0: chunk_frames): fewer make the first audio come sooner.
        self.initial_chunk_frames = int(initial_chunk_frames)
        self.left_context = int(left_context)
        # The codec's codebook size (0: unchecked): a code outside it fails its request here,
        # not the codec's forward (which would fail the whole step).
        self.codebook_size = int(codebook_size)
        if self.chunk_frames < 1 or self.left_context < 0 or self.initial_chunk_frames < 0:
            raise ValueError(f"chunk_frames must be >= 1, left_context and initial_chunk_frames >= 0, got "
                             f"{chunk_frames}, {left_context}, {initial_chunk_frames}")
        # The chunk must reach the forward: one exchange per step that runs a request with a payload.
        # Its chunks are forward kwargs: no FULL CUDA graph may replay a forward without them (refused).
        self.needs = HookNeeds(pre_forward="always", pre_forward_scope="payload", hidden_states=False,
                               prefix_cache_safe=False, model_states=True, extra_kwargs=True)

    def plan(self, state: dict[str, Any]) -> tuple[torch.Tensor, ChunkGrid, int]:
        """(codes [frames, Q], its chunks, left context) of a request."""
        meta = state.get("meta", {})
        grid = ChunkGrid(int(meta.get("codec_chunk_frames", self.chunk_frames)),
                         int(meta.get("initial_codec_chunk_frames", self.initial_chunk_frames)))
        left = int(meta.get("codec_left_context_frames", self.left_context))
        return state["codes"]["audio"], grid, left

    def on_new_requests(self, requests: list[RequestInfo]) -> None:
        errors: dict[str, str] = {}
        try:
            super().on_new_requests(requests)
        except HookErrors as exc:
            errors.update(exc.errors)
        for req in requests:
            state = self.state.get(req.req_id)
            if req.req_id in errors or state is None:
                continue
            if not req.payload:  # no codes to decode (vLLM's own warm-up requests): nothing for it, no error
                self.state.free(req.req_id)
                continue
            problem = _check(state, self)
            if problem:
                errors[req.req_id] = problem
                self.on_finished([req.req_id])
        if errors:
            raise HookErrors(errors)

    def model_states(self, req_ids: list[str]) -> dict[str, dict[str, Any]]:
        """The model's hooks read no state (its chunks come per step): an empty one each."""
        return {r: {} for r in req_ids if r in self.state}

    def build_extra_kwargs(self, batch: StepBatch) -> dict[str, Any]:
        infos: list[dict[str, Any]] = []
        counts: list[int] = []
        lay = batch.layout
        for i, req_id in enumerate(batch.req_ids):
            state = self.state.get(req_id)
            info = None
            start, end = batch.rows(i)
            counts.append(end - start)
            if state is not None:
                step = lay.num_computed_tokens[i] + end - start - int(state["meta"]["prompt_len"])
                codes, grid, left = self.plan(state)
                k = self._chunk_of_step(state, step, codes, grid)
                info = grid_input(codes, k, grid, left) if k is not None else None
            infos.append(info or {})
        # seq_token_counts: each request's rows, as vllm-omni's runners pass them (its code2wav splits
        # input_ids by them when a batch holds several requests).
        return {"runtime_additional_information": infos, "seq_token_counts": counts}

    def _chunk_of_step(self, state: dict[str, Any], step: int, codes: torch.Tensor, grid: ChunkGrid) -> int | None:
        """The chunk step `step` decodes (None: none), decided once per step and kept in the state."""
        meta = state["meta"]
        if step == meta.get(STEP_SEEN, -1):
            return meta.get(STEP_CHUNK)
        k = int(meta.get(NEXT_CHUNK, 0))
        final = not meta.get("codec_streaming", False) or bool(meta.get("codec_final", False))
        decided = k if grid.ready(k, int(codes.shape[0]), final) else None
        # Three ints into the state's own meta: not a merge, which re-sizes the whole state (its codes
        # included) against the cap and snapshots it for all-or-nothing, on every step.
        meta.update({STEP_SEEN: step, STEP_CHUNK: decided, NEXT_CHUNK: k + (decided is not None)})
        return decided

    def stage_mirrored_append(self, req_id: str, payload: bytes, earlier: list[dict[str, Any]]) -> dict[str, Any]:
        """Streamed codes are checked as a payload's are: a bad append is refused to its client,
        never handed to the model."""
        delta = super().stage_mirrored_append(req_id, payload, earlier)
        state = self.state.get(req_id) or {}
        merged = {"codes": {**state.get("codes", {}), **delta.get("codes", {})},
                  "meta": {**state.get("meta", {}), **delta.get("meta", {})}}
        problem = _check(merged, self)
        if problem:
            raise RequestHookError(req_id, f"append refused: {problem}")
        return delta

    def on_payload_appended(self, req_id: str, payload: bytes) -> None:
        self.commit_mirrored_append(req_id, self.stage_mirrored_append(req_id, payload, []))

    def on_finished(self, req_ids: list[str]) -> None:
        for req_id in req_ids:
            state = self.state.get(req_id)
            if state is not None and req_id not in self.preempted and _check(state, self) is None:
                codes, grid, _ = self.plan(state)
                left = grid.count(int(codes.shape[0])) - int(state["meta"].get(NEXT_CHUNK, 0))
                if left > 0:
                    log.warning("code2wav request %s finished with %d of its chunks undecoded: its clock "
                                "(max_tokens) ran out while its codes were still coming; give it more",
                                req_id, left)
        super().on_finished(req_ids)

    def on_model_results(self, updates: dict[str, dict[str, Any]], outputs: dict[str, dict[str, Any]]) -> None:
        errors: dict[str, str] = {}
        try:
            super().on_model_results(updates, {})
        except HookErrors as exc:
            errors.update(exc.errors)
        for req_id, output in outputs.items():
            wave = output.get(MODEL_WAVEFORM) if isinstance(output, dict) else None
            if req_id in errors or wave is None:
                continue
            if not isinstance(wave, torch.Tensor) or wave.dim() != 1:
                errors[req_id] = f"code2wav: {MODEL_WAVEFORM} must be a 1-dim waveform, got {_describe(wave)}"
                continue
            chunk = {WAVEFORM: wave.to(torch.float32).reshape(-1, 1)}
            if isinstance(output.get("sr"), torch.Tensor):
                chunk["sr"] = output["sr"]
            self.log.add(req_id, chunk, self.current_step)
        if errors:
            raise HookErrors(errors)


def _check(state: dict[str, Any], hooks: Code2WavHooks) -> str | None:
    codes = state.get("codes", {}).get("audio") if isinstance(state.get("codes"), dict) else None
    streaming = bool(state.get("meta", {}).get("codec_streaming", False))
    if not isinstance(codes, torch.Tensor) or codes.dim() != 2 or (codes.shape[0] == 0 and not streaming):
        return f"code2wav: the payload needs codes.audio [frames, codebooks], got {_describe(codes)}"
    if codes.dtype.is_floating_point or codes.dtype == torch.bool:
        return f"code2wav: codes.audio must hold integer codes, got {codes.dtype}"
    size = hooks.codebook_size
    if size and codes.numel() and not 0 <= int(codes.min()) <= int(codes.max()) < size:
        return (f"code2wav: codes.audio holds codes outside the codebook [0, {size}): "
                f"{int(codes.min())} .. {int(codes.max())}")
    try:
        _, _, left = hooks.plan(state)
    except (TypeError, ValueError) as exc:
        return f"code2wav: meta.codec_chunk_frames / initial_codec_chunk_frames / codec_left_context_frames: {exc}"
    if left < 0:
        return f"code2wav: left context must be >= 0, got {left}"
    return None


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {list(value.shape)}"
    return type(value).__name__
