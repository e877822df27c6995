"""vllm-omni's Qwen3-Omni-MoE model, one registered class per pipeline stage.

vllm-omni serves every stage of Qwen3-Omni with one class, `Qwen3OmniMoeForConditionalGeneration`
(its qwen3_omni.py), which builds the thinker, the talker or code2wav inside it from the
`model_stage` its own engine arguments add to the ModelConfig (and reads `async_chunk` from there
too). Upstream's ModelConfig has neither field, and upstream already owns that architecture name
(it resolves to upstream's own thinker). So each stage is a subclass here, under its own name,
that sets the two fields vllm-omni's engine would before calling vllm-omni's `__init__`. The inner
classes the outer one builds through upstream's registry (`init_vllm_registered_model` with
vllm-omni's names, which upstream does not have) are vllm-omni's own, named from thinker.py,
talker.py and code2wav.py.
"""

from __future__ import annotations

from typing import Any

from worker_shim.omni_models.package import install_stand_in

install_stand_in()

from vllm_omni.model_executor.models.qwen3_omni import qwen3_omni  # noqa: E402

# vllm-omni's engine-argument default (OmniEngineArgs.async_chunk): whole-request hand-overs.
ASYNC_CHUNK = False


def _set_stage_fields(model_config: Any, stage: str) -> None:
    """The fields vllm-omni's OmniModelConfig adds, on upstream's ModelConfig (this process's copy)."""
    for name, value in (("model_stage", stage), ("async_chunk", ASYNC_CHUNK)):
        if getattr(model_config, name, None) is None:
            object.__setattr__(model_config, name, value)


class Qwen3OmniMoeStage(qwen3_omni.Qwen3OmniMoeForConditionalGeneration):
    """vllm-omni's Qwen3-Omni class, built as the stage `stage` names."""

    stage: str

    def __init__(self, *, vllm_config: Any, prefix: str = "") -> None:
        _set_stage_fields(vllm_config.model_config, self.stage)
        super().__init__(vllm_config=vllm_config, prefix=prefix)


class Qwen3OmniMoeThinkerStage(Qwen3OmniMoeStage):
    """vllm-omni's Qwen3-Omni as its thinker stage: multimodal input, M-RoPE, MoE, and the
    hidden layers the talker reads (its forward returns (hidden, {"hidden_states": {"layers": ...}}))."""

    stage = "thinker"


class Qwen3OmniMoeTalkerStage(Qwen3OmniMoeStage):
    """vllm-omni's Qwen3-Omni as its talker stage (preprocess / postprocess / talker_mtp hooks).
    Load it with `hf_overrides=config.talker_stage_config`, which gives upstream the talker's text
    config and names this architecture."""

    stage = "talker"


class Qwen3OmniMoeCode2WavStage(Qwen3OmniMoeStage):
    """vllm-omni's Qwen3-Omni as its code2wav stage (a generation-only stage)."""

    stage = "code2wav"
