"""The tiny talker as a vLLM model: upstream Qwen3Model backbone + TalkerHeads + vllm-omni's hooks.

Upstream vLLM runs `forward` and `compute_logits` only; the hooks
(`preprocess`, `preprocess_decode_batch`, `talker_mtp`, `postprocess`) are
called by whoever plays vllm-omni's runner (the shim's model-hook bridge).
Without them vLLM still loads and generates: each prompt id is then embedded
as a plain code-0 token. Registered by `tests.tiny_models.talker.register()`.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.model_executor.models.qwen3 import Qwen3Model
from vllm.model_executor.models.utils import AutoWeightsLoader, maybe_prefix

from tests.tiny_models.talker import TalkerHeads, TalkerHooks


class OmniTinyTalkerForConditionalGeneration(TalkerHooks, nn.Module):
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        config = vllm_config.model_config.hf_config
        self.config = config
        self.model = Qwen3Model(vllm_config=vllm_config, prefix=maybe_prefix(prefix, "model"))
        self.heads = TalkerHeads(config)
        self.mtp_hidden_size = int(config.hidden_size)
        self.make_empty_intermediate_tensors = self.model.make_empty_intermediate_tensors

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_input_ids(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate_tensors=None,
        inputs_embeds: torch.Tensor | None = None,
        **_: object,
    ) -> torch.Tensor:
        return self.model(input_ids, positions, intermediate_tensors, inputs_embeds)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.heads.codec_logits(hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        # AutoWeightsLoader hands "model.*" to Qwen3Model.load_weights (fused qkv / gate_up)
        # and loads "heads.*" straight into TalkerHeads' parameters.
        return AutoWeightsLoader(self).load_weights(weights)
