"""An omni hook set that writes, per step and request, what the request's state holds (JSON lines
to $OMNI_STREAM_LOG): the appended meta keys and the `embed.decode` span and rows. Lets an end-to-end
test check that a payload appended mid-stream reaches the next step's hooks, and no earlier one."""

from __future__ import annotations

import json
import os

from omni_sidecar.hook_sets.omni.state_hooks import OmniStateHooks


class StreamProbeHooks(OmniStateHooks):
    name = "stream-probe"

    def __init__(self, **options: str) -> None:
        super().__init__(**options)
        self._log = open(os.environ["OMNI_STREAM_LOG"], "a", buffering=1)

    def process_model_output(self, batch, hidden_states) -> None:
        for i, req_id in enumerate(batch.req_ids):
            state = self.state.get(req_id) or {}
            embed = state.get("embed", {})
            decode = embed.get("decode")
            self._log.write(json.dumps({
                "step": batch.step, "req": req_id, "tag": state.get("meta", {}).get("tag"), "position": batch.layout.num_computed_tokens[i],
                "appended": sorted(k for k in state.get("meta", {}) if k.startswith("appended_")),
                "span": [embed["decode_token_start"], embed["decode_token_end"]] if decode is not None else None,
                "decode": decode[:, 0].tolist() if decode is not None else None,
            }) + "\n")
        super().process_model_output(batch, hidden_states)
