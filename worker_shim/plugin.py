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
    from worker_shim.config import shim_selected, triton_interpreted

    if shim_selected():
        os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "1")
    if triton_interpreted():
        try:
            from worker_shim.upstream.compat import TOPK_TOPP_TRITON_FLAG

            module, name = TOPK_TOPP_TRITON_FLAG
            sampler = importlib.import_module(module)
            if hasattr(sampler, name):
                setattr(sampler, name, False)
        except Exception:  # an upstream rename must not stop vLLM from starting
            pass
    register_models()


REGISTER_ENV = "OMNI_REGISTER_MODELS"


def register_models() -> None:
    """`OMNI_REGISTER_MODELS="pkg.module:function,..."`: functions that register out-of-tree model
    classes with vLLM's ModelRegistry, called here because this plugin runs in every vLLM process
    (engine core and workers start with `spawn`, which does not re-run a package's `__main__`)."""
    for spec in filter(None, os.environ.get(REGISTER_ENV, "").split(",")):
        module, _, name = spec.partition(":")
        getattr(importlib.import_module(module), name)()
