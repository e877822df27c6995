"""`vllm.general_plugins` entry point: runs in every vLLM process at start-up.

When the shim is selected (`OMNI_SIDECAR_ENDPOINT` set, or `OMNI_SIDECAR=1`),
it makes vLLM pick Model Runner V2. On CPU hosts running V2's Triton kernels in
the interpreter it also routes top-k/top-p to the torch path, which the
interpreter cannot run.
"""

from __future__ import annotations

import importlib
import os


def register() -> None:
    enabled = os.environ.get("OMNI_SIDECAR_ENDPOINT") or os.environ.get("OMNI_SIDECAR") == "1"
    if enabled:
        os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "1")
    if os.environ.get("TRITON_INTERPRET") == "1":
        try:
            from worker_shim.compat import OPTIONAL_NAMES

            module, name = OPTIONAL_NAMES[0]
            sampler = importlib.import_module(module)
            if hasattr(sampler, name):
                setattr(sampler, name, False)
        except Exception:  # an upstream rename must not stop vLLM from starting
            pass
