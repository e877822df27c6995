"""vllm-omni's Qwen3-TTS talker with the M-RoPE interface upstream V2 asks for.

The published checkpoints' talker config has an M-RoPE section (`rope_scaling.mrope_section`),
so upstream V2 keeps three position streams per token and asserts the model is `SupportsMRoPE`
(`get_rope_state`); vllm-omni's class is a plain nn.Module (vllm-omni's runners compute its
positions themselves). Why arange x3 with delta 0 is exact: a talker prompt is codec and text
rows only, no image or video token (vllm-omni's config sets their ids to -1), so vllm-omni's own
M-RoPE position builder gives every token the same position p in all three streams with delta 0
(its `_vl_get_input_positions_tensor` with no vision tokens). Decode then continues at
num_computed + delta in every stream, the same p. Three equal streams make the M-RoPE cos/sin,
section by section, the plain RoPE of position p with the same inv_freq: the same numbers, and
the same M-RoPE kernel as vllm-omni's runner, which also passes [3, T] positions.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.model_executor.models.interfaces import SupportsMRoPE

from worker_shim.omni_models.package import install_stand_in

install_stand_in()

from vllm_omni.model_executor.models.qwen3_tts import qwen3_tts_talker  # noqa: E402

MROPE_STREAMS = 3  # (t, h, w), as the published config's mrope_section has three parts


class Qwen3TTSTalkerForConditionalGeneration(qwen3_tts_talker.Qwen3TTSTalkerForConditionalGeneration, SupportsMRoPE):
    """vllm-omni's talker, unchanged, plus `SupportsMRoPE.get_mrope_input_positions`."""

    def get_mrope_input_positions(self, input_tokens: list[int], mm_features: list[Any]) -> tuple[torch.Tensor, int]:
        n = len(input_tokens)
        return torch.arange(n, dtype=torch.int64).expand(MROPE_STREAMS, n), 0
