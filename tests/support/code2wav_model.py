"""The tiny code2wav as a vLLM model: upstream Qwen3ForCausalLM (one layer) for vLLM's token stream + Code2WavDecoder.

Generation-only on unmodified V2 (docs/ARCHITECTURE.md, "Generation-only stages"):
V2 schedules, runs and samples every request each step whatever the model is, so the
request is a clock: one placeholder prompt token, then one sampled token per chunk.
Upstream's one-layer Qwen3 gives V2 what it needs of any model (token embeddings, an
attention layer with a KV cache, hidden rows); `compute_logits` returns equal logits,
so any sampled token is fine and none is read. The work is in `forward`'s
`runtime_additional_information` (vllm-omni's per-request list, in batch order),
which the `omni-code2wav` sidecar fills each step with the request's next chunk:
`codes.audio` (flat, codebook-major [Q * frames]) and `meta.left_context_size`.
The waveform chunks, left context cut off, go out as vllm-omni's code2wav returns
them: an OmniOutput-shaped NamedTuple whose `multimodal_outputs["model_outputs"]`
holds one 1-dim waveform per request (None where a request had no chunk).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from vllm.config import VllmConfig
from vllm.model_executor.models.qwen3 import Qwen3ForCausalLM

from tests.tiny_models.code2wav import Code2WavDecoder, decode_runtime_info


class Code2WavOutput(NamedTuple):  # the shape of vllm-omni's OmniOutput
    text_hidden_states: torch.Tensor
    multimodal_outputs: dict[str, Any] | None = None


class OmniTinyCode2Wav(Qwen3ForCausalLM):
    have_multimodal_outputs = True  # vllm-omni's flag: forward returns per-request outputs
    has_preprocess = False
    has_postprocess = False

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        self.decoder = Code2WavDecoder(self.config)  # loaded by upstream's load_weights ("decoder.*")
        self.sample_rate = int(self.config.output_sample_rate)

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate_tensors=None,
        inputs_embeds: torch.Tensor | None = None,
        runtime_additional_information: list[dict[str, Any]] | None = None,
        **_: object,
    ) -> torch.Tensor | Code2WavOutput:
        hidden = super().forward(input_ids, positions, intermediate_tensors, inputs_embeds)
        if not runtime_additional_information:
            return hidden  # warm-up, profiling, or no sidecar: nothing to decode
        waves = [decode_runtime_info(self.decoder, info) for info in runtime_additional_information]
        rate = torch.tensor(self.sample_rate, dtype=torch.int32)
        return Code2WavOutput(hidden, {"model_outputs": waves, "sr": [rate if w is not None else None for w in waves]})

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        # Equal logits: the sampled token is a clock tick, never read (generation-only).
        return hidden_states.new_zeros(hidden_states.shape[0], int(self.config.vocab_size))
