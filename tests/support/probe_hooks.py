"""Overlay hooks that log, per step, whether the step needed a pre-forward exchange and got one.

The need is judged here, on the sidecar side, from the batch layout and the
payloads the sidecar holds; the shim decides on its own. Lines go to the
JSON-lines file named by $OMNI_PROBE_LOG.
"""

from __future__ import annotations

import json
import os

from omni_sidecar.hook_sets.reference import PromptEmbedsOverlayHooks


class ProbeOverlayHooks(PromptEmbedsOverlayHooks):
    name = "probe-overlay"

    def __init__(self) -> None:
        super().__init__()
        self.begins: dict[int, int] = {}

    def prepare_prefill_embeds(self, batch):
        self.begins[batch.step] = self.begins.get(batch.step, 0) + 1
        return super().prepare_prefill_embeds(batch)

    def process_model_output(self, batch, hidden_states) -> None:
        lay = batch.layout
        needed = any(
            lay.num_computed_tokens[i] < lay.prefill_lens[i] and r in self._embeds
            for i, r in enumerate(lay.req_ids)
        )
        with open(os.environ["OMNI_PROBE_LOG"], "a") as f:
            f.write(json.dumps({"step": batch.step, "needed": needed,
                                "begins": self.begins.pop(batch.step, 0),
                                "rows": lay.query_start_loc[-1]}) + "\n")


class ThreadsProbeHooks(PromptEmbedsOverlayHooks):
    """Writes torch's intra-op thread count, as the sidecar process runs its hooks, to the file
    named by the `out` hook option (the sidecar's `--torch-threads`)."""

    name = "threads-probe"

    def __init__(self, out: str) -> None:
        super().__init__()
        import torch

        with open(out, "w") as f:
            f.write(str(torch.get_num_threads()))
