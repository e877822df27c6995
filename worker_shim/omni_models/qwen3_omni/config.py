"""The talker stage's text config, through upstream's `hf_overrides` callable.

Upstream's ModelConfig takes its text config (vocabulary, hidden size, layers, heads, M-RoPE section,
all of V2's buffer sizes) from `hf_config.get_text_config()`, which for Qwen3-Omni is the thinker's.
That is what vllm-omni's thinker and code2wav stages use too (code2wav's stage config names
`thinker_config`), but its talker stage names `talker_config`, whose text model is another one
(published: vocabulary 3072, hidden 1024, against the thinker's 152064 and 2048). vllm-omni gets it by
overriding `ModelConfig.draw_hf_text_config` in its OmniModelConfig; upstream's seam is
`hf_overrides`, which may be a function of the loaded config: `talker_stage_config` returns it as a
subclass whose text config is the talker's, and names the talker stage's architecture.
transformers only: no vllm_omni import, so a pickled config never loads vllm-omni.
"""

from __future__ import annotations

from typing import Any

from transformers import Qwen3OmniMoeConfig

from worker_shim.omni_models.registration import QWEN3_OMNI_TALKER_STAGE


class Qwen3OmniMoeTalkerStageConfig(Qwen3OmniMoeConfig):
    """transformers' Qwen3-Omni config whose text config is the talker's."""

    def __init__(self, **kwargs: Any) -> None:
        # Its own __init__ so that transformers does not wrap it (see qwen3_tts/config.py).
        super().__init__(**kwargs)

    def get_text_config(self, *args: Any, **kwargs: Any) -> Any:
        return self.talker_config.get_text_config(*args, **kwargs)


def talker_stage_config(config: Qwen3OmniMoeConfig) -> Qwen3OmniMoeConfig:
    """`hf_overrides=talker_stage_config`: the talker stage of a Qwen3-Omni checkpoint. Other configs
    pass unchanged (vLLM also calls it on a bare config, to read the model_type it gives)."""
    if not isinstance(config, Qwen3OmniMoeConfig):
        return config
    config.__class__ = Qwen3OmniMoeTalkerStageConfig  # same fields; only the text config it names differs
    config.architectures = [QWEN3_OMNI_TALKER_STAGE]
    return config
