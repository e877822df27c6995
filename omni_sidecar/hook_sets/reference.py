"""Reference hook sets: pass-through, hidden-state capture, prefill-embeds overlay."""

from __future__ import annotations

import torch

from omni_sidecar.hook_api.hook_set import HookErrors, OmniHooks, RequestInfo, StepBatch
from omni_sidecar.hook_sets.omni.wire import PayloadError, decode_tensor_spec
from proto.messages import HookNeeds


class PassThroughHooks(OmniHooks):
    """Sees every step and request, changes nothing: the baseline for overhead and identity."""

    name = "passthrough"
    needs = HookNeeds()


class CaptureHiddenHooks(OmniHooks):
    """Keeps each request's last-layer hidden states of every scheduled token.

    Output "hidden_states" is [tokens computed so far, hidden]; in order of
    position (prompt tokens, then every generated token that was fed back).
    """

    name = "capture"
    needs = HookNeeds(hidden_states=True)
    state_version = "capture/1"
    accepts_state = ("capture/1",)

    def export_state(self) -> dict:
        return {"rows": {r: torch.cat(rows) if rows else torch.empty(0) for r, rows in self._rows.items()}}

    def import_state(self, state: dict) -> None:
        self._rows = {r: ([t] if t.numel() else []) for r, t in state.get("rows", {}).items()}

    def __init__(self) -> None:
        self._rows: dict[str, list[torch.Tensor]] = {}
        self._last_step: dict[str, int] = {}  # the step of each request's last rows

    def on_new_requests(self, requests: list[RequestInfo]) -> None:
        for req in requests:
            # A re-added (preempted) request recomputes from scratch in V2.
            self._rows[req.req_id] = []

    def process_model_output(self, batch: StepBatch, hidden_states: torch.Tensor | None) -> None:
        if hidden_states is None:
            return
        last = self._last_step
        for i, req_id in enumerate(batch.req_ids):
            start, end = batch.rows(i)
            self._rows.setdefault(req_id, []).append(hidden_states[start:end].clone())
            last[req_id] = batch.step

    def on_discarded(self, steps: dict[str, int]) -> None:
        for req_id, step in steps.items():
            rows = self._rows.get(req_id)
            if rows and self._last_step.get(req_id) == step:
                rows.pop()
                self._last_step.pop(req_id)

    def get_outputs(self, req_id: str) -> dict[str, torch.Tensor] | None:
        rows = self._rows.get(req_id)
        if rows is None:
            return None
        return {"hidden_states": torch.cat(rows) if rows else torch.empty(0)}

    def on_finished(self, req_ids: list[str]) -> None:
        for req_id in req_ids:
            self._rows.pop(req_id, None)
            self._last_step.pop(req_id, None)


def check_prompt_embeds(embeds: torch.Tensor, prompt_len: int) -> torch.Tensor:
    if embeds.dim() != 2 or embeds.shape[0] != prompt_len:
        raise PayloadError(
            f"prompt_embeds shape {list(embeds.shape)} does not match the prompt length "
            f"{prompt_len}; send [prompt_len, hidden]"
        )
    return embeds


def overlay_rows(
    batch: StepBatch, embeds_of: dict[str, torch.Tensor]
) -> list[tuple[int, torch.Tensor]]:
    """Prompt rows of this step that take embeddings (docs/ARCHITECTURE.md, "vllm-omni semantics": prefill overlay row math)."""
    out: list[tuple[int, torch.Tensor]] = []
    if not embeds_of:
        return out
    for i, req_id in enumerate(batch.req_ids):
        embeds = embeds_of.get(req_id)
        if embeds is None:
            continue
        start, k, nc = batch.prefill_rows(i)
        k = min(k, embeds.shape[0] - nc)  # a resumed request also re-prefills outputs
        if k > 0:
            out.append((start, embeds[nc : nc + k]))
    return out


class PromptEmbedsOverlayHooks(OmniHooks):
    """Overlays prompt rows of inputs_embeds with the request's `prompt_embeds` payload.

    Client side: `extra_args={"omni_sidecar": {"prompt_embeds": {"data": bytes,
    "shape": [prompt_len, hidden], "dtype": "float32"}}}` with a token prompt of
    the same length (the token ids are placeholders). Chunked-prefill aware.
    """

    name = "overlay"
    needs = HookNeeds(pre_forward="prefill", pre_forward_scope="payload", prefix_cache_safe=False)
    state_version = "overlay/1"
    accepts_state = ("overlay/1",)

    def export_state(self) -> dict:
        return {"embeds": dict(self._embeds)}

    def import_state(self, state: dict) -> None:
        self._embeds = dict(state.get("embeds", {}))

    def __init__(self) -> None:
        self._embeds: dict[str, torch.Tensor] = {}

    def on_new_requests(self, requests: list[RequestInfo]) -> None:
        errors = {}
        for req in requests:
            spec = (req.payload or {}).get("prompt_embeds")
            if spec is None:
                continue
            try:
                self._embeds[req.req_id] = check_prompt_embeds(
                    decode_tensor_spec(spec, "prompt_embeds"), req.prompt_len
                )
            except PayloadError as exc:
                errors[req.req_id] = f"bad prompt_embeds payload: {exc}"
        if errors:
            raise HookErrors(errors)

    def prepare_prefill_embeds(self, batch: StepBatch) -> list[tuple[int, torch.Tensor]]:
        return overlay_rows(batch, self._embeds)

    def on_finished(self, req_ids: list[str]) -> None:
        for req_id in req_ids:
            self._embeds.pop(req_id, None)


def builtin_hooks() -> dict[str, type[OmniHooks]]:
    from omni_sidecar.hook_sets.omni.code2wav import Code2WavHooks
    from omni_sidecar.hook_sets.omni.state_hooks import OmniStateHooks
    from omni_sidecar.hook_sets.omni.stages import TalkerHooks, ThinkerHooks

    classes = (PassThroughHooks, CaptureHiddenHooks, PromptEmbedsOverlayHooks, OmniStateHooks,
               ThinkerHooks, TalkerHooks, Code2WavHooks)
    return {cls.name: cls for cls in classes}

