"""omni-talker plus a digest of its own state per step, so a test can see the sidecar's state.

After each step's model results are merged, every request that got results emits
`state.text_pos` (the text row its next decode step reads), `state.codes` (the last
codes row held in state) and `state.probe` once a client appended `meta.probe`; assembled, the latest step's values win. Both come from the
sidecar's state, which a hot upgrade hands to the successor.
"""

from __future__ import annotations

from typing import Any

import torch

from omni_sidecar.hook_sets.omni.stages import TalkerHooks


class StateDigestTalkerHooks(TalkerHooks):
    name = "omni-talker-digest"

    def on_model_results(self, updates: dict[str, dict[str, Any]], outputs: dict[str, dict[str, Any]]) -> None:
        super().on_model_results(updates, outputs)
        for req_id in updates:
            state = self.state.get(req_id) or {}
            codes = state.get("codes", {}).get("audio")
            digest = {"state.text_pos": torch.tensor(int(state.get("meta", {}).get("text_pos", -1)))}
            if isinstance(codes, torch.Tensor):
                digest["state.codes"] = codes.reshape(-1)
            if "probe" in state.get("meta", {}):  # appended mid-stream (test_e2e_talker)
                digest["state.probe"] = torch.tensor(int(state["meta"]["probe"]))
            self.log.add(req_id, digest, self.current_step)
