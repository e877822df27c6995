"""An omni hook set that overlays only the last rows of a prompt (chunk-aware).

The payload's `model_intermediate_buffer` carries `embed.tail`, E [m, hidden]:
prompt positions P-m .. P-1 take E's rows, every other row stays what vLLM built
(on a multimodal model: token embeddings with the image encoder's rows merged in).
"""

from __future__ import annotations

import torch

from omni_sidecar.hook_api.hook_set import StepBatch
from omni_sidecar.hook_sets.omni.state_hooks import OmniStateHooks


class TailOverlayHooks(OmniStateHooks):
    name = "tail-overlay"

    def prepare_prefill_embeds(self, batch: StepBatch) -> list[tuple[int, torch.Tensor]]:
        pairs = []
        for i, req_id in enumerate(batch.req_ids):
            tail = (self.state.get(req_id) or {}).get("embed", {}).get("tail")
            if tail is None:
                continue
            start, k, nc = batch.prefill_rows(i)
            prompt_len = batch.layout.prefill_lens[i]
            first = prompt_len - tail.shape[0]  # the prompt position of tail[0]
            lo, hi = max(nc, first), min(nc + k, prompt_len)
            if lo < hi:
                pairs.append((start + lo - nc, tail[lo - first : hi - first]))
        return pairs
