"""An omni hook set whose every step depends on the state of the step before.

For each scheduled request it checks that `meta.num_processed_tokens` in its
state equals the tokens vLLM says are already computed; a request whose state
is missing or stale fails with an error. After a hot upgrade this can only
pass if the state was handed over intact.
"""

from __future__ import annotations

from omni_sidecar.hook_api.hook_set import HookErrors
from omni_sidecar.hook_sets.omni.state_hooks import OmniStateHooks


class StateCheckHooks(OmniStateHooks):
    name = "state-check"

    def process_model_output(self, batch, hidden_states) -> None:
        errors = {}
        lay = batch.layout
        for i, req_id in enumerate(lay.req_ids):
            state = self.state.get(req_id)
            if state is None:
                errors[req_id] = "state lost"
                continue
            seen = state.get("meta", {}).get("num_processed_tokens", 0)
            if seen != lay.num_computed_tokens[i]:
                errors[req_id] = f"state says {seen} tokens processed, vLLM says {lay.num_computed_tokens[i]}"
        super().process_model_output(batch, hidden_states)
        if errors:
            raise HookErrors(errors)


class IncompatibleHooks(OmniStateHooks):
    """Keeps its state in a layout the others cannot read."""

    name = "state-v2"
    state_version = "omni/2"
    accepts_state = ("omni/2",)
