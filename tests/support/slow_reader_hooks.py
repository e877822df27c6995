"""Hooks that read every step's hidden states and take longer over them than a step takes
(tests/test_async_scheduling.py): a sidecar the steps outrun."""

from __future__ import annotations

import time

from omni_sidecar.hook_api.hook_set import OmniHooks, StepBatch
from proto.messages import HookNeeds

READ_S = 0.03  # per step, in process_model_output


class SlowReaderHooks(OmniHooks):
    name = "slow-reader"
    needs = HookNeeds(hidden_states=True)

    def process_model_output(self, batch: StepBatch, hidden_states: object) -> None:
        time.sleep(READ_S)
