"""Registers vllm-omni's Qwen3-TTS and Qwen3-Omni classes with upstream vLLM, from the shim's plugin.

In every vLLM process (front-end, engine core, workers, the registry's inspection subprocess)
the plugin calls `register_vllm_omni_models()`. Where vllm-omni is installed, its package not
imported and `OMNI_SIDECAR_VLLM_OMNI_MODELS` is not off, it stands the package in, registers
our Qwen3-TTS config subclass with AutoConfig (config.json's model_type "qwen3_tts"; Qwen3-Omni's
"qwen3_omni_moe" is transformers' own) and the architecture names below with upstream's
ModelRegistry as "module:Class" strings naming our modules:
vLLM imports them only when a model asks for one, in whichever process it does. Architectures
already registered (upstream's own, a user's) are left as they are.
"""

from __future__ import annotations

import logging

from worker_shim.omni_models.package import install_stand_in, installed_folder, real_package_loaded
from worker_shim.upstream.compat import QWEN3_TTS_MODEL_TYPE

log = logging.getLogger("vllm.omni_sidecar.shim.omni_models")

_TALKER = "worker_shim.omni_models.qwen3_tts.talker:Qwen3TTSTalkerForConditionalGeneration"
_CODE2WAV = "worker_shim.omni_models.qwen3_tts.code2wav:Qwen3TTSCode2Wav"
_STAGES = "worker_shim.omni_models.qwen3_omni.stages"
QWEN3_OMNI_TALKER_STAGE = "Qwen3OmniMoeTalkerStage"  # with hf_overrides=qwen3_omni.config.talker_stage_config
# The architecture to name per Qwen3-Omni stage (the talker's through talker_stage_config).
QWEN3_OMNI_STAGES = {"thinker": "Qwen3OmniMoeThinkerStage", "talker": QWEN3_OMNI_TALKER_STAGE,
                     "code2wav": "Qwen3OmniMoeCode2WavStage"}
# vllm-omni's architecture names for these classes (its models/registry.py, 0.26 and 0.30), and,
# for Qwen3-Omni, one name per stage of its outer class (upstream owns the outer name, and the
# stage is an engine argument there: qwen3_omni/stages.py). Its outer class builds the inner ones
# through upstream's registry under vllm-omni's names.
ARCHITECTURES = {
    "Qwen3TTSForConditionalGeneration": _TALKER,
    "Qwen3TTSTalkerForConditionalGeneration": _TALKER,
    "Qwen3TTSCode2Wav": _CODE2WAV,
    **{arch: f"{_STAGES}:{arch}" for arch in QWEN3_OMNI_STAGES.values()},
    "Qwen3OmniMoeThinkerForConditionalGeneration":
        "worker_shim.omni_models.qwen3_omni.thinker:Qwen3OmniMoeThinkerForConditionalGeneration",
    "Qwen3OmniMoeTalkerForConditionalGeneration":
        "worker_shim.omni_models.qwen3_omni.talker:Qwen3OmniMoeTalkerForConditionalGeneration",
    "Qwen3OmniMoeCode2Wav": "worker_shim.omni_models.qwen3_omni.code2wav:Qwen3OmniMoeCode2Wav",
}


def register_vllm_omni_models() -> list[str]:
    """The architectures registered here ([] where vllm-omni is absent, imported for real, or off)."""
    from worker_shim.config import vllm_omni_models

    if vllm_omni_models() == "off" or real_package_loaded() or installed_folder() is None:
        return []
    try:
        install_stand_in()
        from worker_shim.omni_models.qwen3_tts.config import Qwen3TTSConfig
    except Exception as exc:  # a vllm-omni that does not import here must not stop vLLM for other models
        log.warning("omni-sidecar: vllm-omni's Qwen3-TTS config does not import (%s: %s); its models stay "
                    "unregistered", type(exc).__name__, exc)
        return []
    from transformers import AutoConfig
    from vllm import ModelRegistry

    AutoConfig.register(QWEN3_TTS_MODEL_TYPE, Qwen3TTSConfig, exist_ok=True)
    known = set(ModelRegistry.get_supported_archs())
    added = [arch for arch in ARCHITECTURES if arch not in known]
    for arch in added:
        ModelRegistry.register_model(arch, ARCHITECTURES[arch])
    log.debug("omni-sidecar: vllm-omni's %s registered, loaded without its patches", ", ".join(added))
    return added
