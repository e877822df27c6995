"""vllm-omni's Qwen3-TTS config class, registered with transformers' AutoConfig.

The subclass is ours so that a pickled config (vLLM passes the VllmConfig to the processes it
spawns) names this module: unpickling it imports this module first, which stands vllm_omni in
before vllm-omni's config module loads. The nested configs (talker, code predictor, speaker
encoder) are vllm-omni's own classes; a copyreg reducer makes their pickles name this module
first too, so the order in which vLLM pickles them does not matter.
"""

from __future__ import annotations

import copyreg
from typing import Any, Callable

from worker_shim.omni_models.package import install_stand_in

install_stand_in()

from vllm_omni.model_executor.models.qwen3_tts import configuration_qwen3_tts as vllm_omni_config  # noqa: E402


class Qwen3TTSConfig(vllm_omni_config.Qwen3TTSConfig):
    """vllm-omni's `Qwen3TTSConfig` (model_type "qwen3_tts"), named by this module."""

    def __init__(self, **kwargs: Any) -> None:
        # Its own __init__ because transformers (5.x) wraps a config subclass without one so that
        # every keyword is set as an attribute afterwards: the nested configs would be dicts again.
        super().__init__(**kwargs)


def rebuilt(make: Callable[..., Any], args: tuple) -> Any:
    """Unpickling a nested config: this module is imported (vllm_omni stood in) before its class."""
    return make(*args)


def _reduce(config: Any) -> tuple:
    make, args, *rest = config.__reduce_ex__(2)
    return (rebuilt, (make, args), *rest)


for _nested in (vllm_omni_config.Qwen3TTSTalkerConfig, vllm_omni_config.Qwen3TTSTalkerCodePredictorConfig,
                vllm_omni_config.Qwen3TTSSpeakerEncoderConfig):
    copyreg.pickle(_nested, _reduce)
