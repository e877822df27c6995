"""`vllm.general_plugins` entry point: runs in every vLLM process at start-up.

When the shim is selected (`OMNI_SIDECAR_ENDPOINT` set, or `OMNI_SIDECAR=1`),
it makes vLLM pick Model Runner V2. On CPU hosts running V2's Triton kernels in
the interpreter it also routes top-k/top-p to the torch path, which the
interpreter cannot run. Where vllm-omni is installed, it registers vllm-omni's
Qwen3-TTS classes, loaded without its patches (worker_shim/omni_models/), and
checks that no patch of vllm-omni's is in the process: vLLM imports every
plugin before it calls any, so by now vllm-omni's own entry point, if it was
let in, has run. Where the shim is selected by the environment, a patch found
stops vLLM here, in every process (front-end, engine core, workers); the shim's
worker checks again whatever selected it (worker_shim/omni_models/patches.py).
"""

from __future__ import annotations

import importlib
import logging
import os

log = logging.getLogger("vllm.omni_sidecar.shim.plugin")


def register() -> None:
    from worker_shim.config import shim_selected, triton_interpreted
    from worker_shim.omni_models.patches import require_unpatched
    from worker_shim.omni_models.registration import register_vllm_omni_models

    if shim_selected():
        os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "1")
        require_unpatched("vLLM's plugins loaded")
    if register_vllm_omni_models() and shim_selected():
        log.info("omni-sidecar: vllm-omni's Qwen3-TTS classes registered; no vllm-omni patch in this process")
    if triton_interpreted():
        try:
            from worker_shim.upstream.compat import TOPK_TOPP_TRITON_FLAG

            module, name = TOPK_TOPP_TRITON_FLAG
            sampler = importlib.import_module(module)
            if hasattr(sampler, name):
                setattr(sampler, name, False)
        except Exception:  # an upstream rename must not stop vLLM from starting
            pass
