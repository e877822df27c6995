"""vllm-omni's Qwen3-TTS code2wav stage, as upstream vLLM's registry imports it.

The class is vllm-omni's own, unchanged (it needs nothing more from upstream V2: its config
drops the M-RoPE section for this architecture); it is named from this module so that the
registry's import (in the engine or its inspection subprocess) stands vllm_omni in first.
"""

from __future__ import annotations

from worker_shim.omni_models.package import install_stand_in

install_stand_in()

from vllm_omni.model_executor.models.qwen3_tts.qwen3_tts_code2wav import Qwen3TTSCode2Wav  # noqa: E402

__all__ = ["Qwen3TTSCode2Wav"]
