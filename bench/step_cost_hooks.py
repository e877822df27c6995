"""A hook set for bench/step_cost.py: pass-through, but it reads every step's layout."""

from __future__ import annotations

from omni_sidecar.hook_api.hook_set import OmniHooks, StepBatch


class ObservingPassThrough(OmniHooks):
    """Changes nothing and needs no tensors, but overrides `process_model_output`: the sidecar
    must get every step's layout, so every step sends a full StepEnd (the cost the StepTick saves)."""

    name = "observe"

    def __init__(self) -> None:
        self.rows = 0

    def process_model_output(self, batch: StepBatch, hidden_states: object) -> None:
        self.rows += len(batch.req_ids)
