"""vllm-omni's Qwen3-TTS config class, registered with transformers' AutoConfig.

The subclass is ours so that a pickled config (vLLM passes the VllmConfig to the processes it
spawns) names this module: unpickling it imports this module first, which stands vllm_omni in
before vllm-omni's config module loads. Its nested configs (talker, code predictor, speaker
encoder) are vllm-omni's own classes, pickled inside it and so met after it; a process where
vllm-omni's real package loaded anyway is stopped by the start-up patch check (patches.py).
"""

from __future__ import annotations

from typing import Any

from worker_shim.omni_models.package import install_stand_in

install_stand_in()

from vllm_omni.model_executor.models.qwen3_tts import configuration_qwen3_tts as vllm_omni_config  # noqa: E402


class Qwen3TTSConfig(vllm_omni_config.Qwen3TTSConfig):
    """vllm-omni's `Qwen3TTSConfig` (model_type "qwen3_tts"), named by this module."""

    def __init__(self, **kwargs: Any) -> None:
        # Its own __init__ because transformers (5.x) wraps a config subclass without one so that
        # every keyword is set as an attribute afterwards: the nested configs would be dicts again.
        super().__init__(**kwargs)

