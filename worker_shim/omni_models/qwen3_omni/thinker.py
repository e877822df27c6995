"""vllm-omni's Qwen3-Omni thinker, unchanged: built on upstream's Qwen3-Omni thinker module, plus
the layer capture its talker reads.

vllm-omni's outer class (stages.py) builds it through upstream's registry under vllm-omni's name;
the name points here so that the registry's import stands vllm_omni in first.
"""

from __future__ import annotations

from worker_shim.omni_models.package import install_stand_in

install_stand_in()

from vllm_omni.model_executor.models.qwen3_omni.qwen3_omni_moe_thinker import (  # noqa: E402
    Qwen3OmniMoeThinkerForConditionalGeneration)

__all__ = ["Qwen3OmniMoeThinkerForConditionalGeneration"]
