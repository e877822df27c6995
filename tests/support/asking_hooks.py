"""Hooks that ask for a plan before every forward (tests/test_step_traffic.py): pre_forward "always",
every request in scope, no overlay rows; they read no per-step layout after the forward."""

from __future__ import annotations

from omni_sidecar.hook_api.hook_set import OmniHooks
from proto.messages import HookNeeds


class AskEveryStepHooks(OmniHooks):
    name = "ask-every-step"
    needs = HookNeeds(pre_forward="always")
