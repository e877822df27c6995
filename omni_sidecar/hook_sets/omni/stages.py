"""A thinker -> talker pair of hook sets, the shape of Qwen-Omni's and Qwen3-TTS's stages.

`omni-thinker`: assembles each request's last-layer hidden states (token
aligned), which a client hands to the next stage as its prompt payload. The
request's first chunk also carries `prompt_len` (prompt rows, multimodal
placeholders included), so a next stage that follows the stream knows which rows
are the prompt's before the request finishes.

`omni-talker`: for a talker model that carries vllm-omni's own hooks (preprocess,
talker_mtp, postprocess), which the shim calls in the vLLM process
(docs/ARCHITECTURE.md, "Model hooks"). What remains here needs no weights: each
request's payload is decoded into the state the model reads (sent to the shim once),
the model's per-step updates are merged into that state (so it survives a hot
upgrade), and its code-predictor codes are assembled per request as `codes.audio`
[decode steps, codebooks], streamed per step. A voice-cloning request's reference codes,
which the model's preprocess writes into its state (`codes.ref`, `meta.ref_code_len`), are
published once as outputs of the same names, as vllm-omni's talker publishes them for its
code2wav stage (`make_omni_output`, which vllm-omni's runner calls and upstream's does not).
It needs no hidden states and no blocking exchange except on steps that bring new requests.
"""

from __future__ import annotations

from typing import Any

import torch

from omni_sidecar.hook_sets.omni.outputs import own_copy
from omni_sidecar.hook_sets.omni.state_hooks import DEFAULT_RESIDENT_KEYS, OmniStateHooks
from proto.messages import HookNeeds
from proto.settings import REF_CODE_LEN, REF_CODES

PROMPT_LEN = "prompt_len"  # output value: the request's prompt rows, in its first chunk


class ThinkerHooks(OmniStateHooks):
    name = "omni-thinker"

    def postprocess(
        self, req_id: str, hidden_rows: torch.Tensor, state: dict[str, Any]
    ) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
        first = int(state.get("meta", {}).get("num_processed_tokens", 0)) == 0
        update, outputs = super().postprocess(req_id, hidden_rows, state)
        if first and outputs is not None:
            outputs[PROMPT_LEN] = int(state["meta"]["prompt_len"])
        return update, outputs


class TalkerHooks(OmniStateHooks):
    name = "omni-talker"
    # The model's own preprocess reads `embed.prefill` (Qwen3-Omni's talker: the thinker's rows, not
    # one per talker prompt row) and writes the prompt's embeddings itself.
    prefill_overlays_prompt = False

    def __init__(self, state_cap_mib: str = "256", resident_keys: str = DEFAULT_RESIDENT_KEYS) -> None:
        super().__init__(state_cap_mib=state_cap_mib, resident_keys=resident_keys)
        self.needs = HookNeeds(pre_forward="never", hidden_states=False, prefix_cache_safe=False,
                               model_states=True)

    def on_model_results(self, updates: dict[str, dict[str, Any]], outputs: dict[str, dict[str, Any]]) -> None:
        """As the omni set's; a reference the model's update brings is published too (a request whose
        update the state refuses fails, its outputs with it)."""
        for req_id, update in updates.items():
            codes = update.get("codes") if isinstance(update, dict) else None
            reference = codes.get("ref") if isinstance(codes, dict) else None
            if isinstance(reference, torch.Tensor) and reference.dim() == 2 and reference.shape[0]:
                meta = update.get("meta")
                length = meta.get("ref_code_len", reference.shape[0]) if isinstance(meta, dict) else reference.shape[0]
                self.log.add(req_id, {REF_CODES: own_copy(reference), REF_CODE_LEN: int(length)}, self.current_step)
        super().on_model_results(updates, outputs)
