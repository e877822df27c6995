"""vllm-omni's Qwen3-TTS code2wav stage, with what upstream V2 needs of every model.

vllm-omni runs this stage with its own generation runner, which samples nothing: its
`forward` returns an OmniOutput without hidden states and its `compute_logits` returns None.
Upstream V2 samples a token for every scheduled request every step, so the shim runs a
code2wav request as a clock (docs/ARCHITECTURE.md, "Generation-only stages"): this subclass
calls vllm-omni's own methods and, where they give V2 nothing, gives it zero hidden rows and
equal (zero) logits; no sampled token is read. The waveforms are vllm-omni's, untouched, in
`multimodal_outputs`. Named from this module so that the registry's import (in the engine or
its inspection subprocess) stands vllm_omni in first.
"""

from __future__ import annotations

from typing import Any

import torch

from worker_shim.omni_models.package import install_stand_in

install_stand_in()

from vllm_omni.model_executor.models.qwen3_tts import qwen3_tts_code2wav  # noqa: E402


class Qwen3TTSCode2Wav(qwen3_tts_code2wav.Qwen3TTSCode2Wav):
    """vllm-omni's code2wav, plus hidden rows and logits for upstream V2's sampling clock."""

    def forward(self, input_ids: torch.Tensor | None = None, positions: torch.Tensor | None = None,
                *args: Any, **kwargs: Any) -> Any:
        output = super().forward(input_ids, positions, *args, **kwargs)
        if getattr(output, "text_hidden_states", None) is not None:
            return output
        rows = positions.shape[-1] if positions is not None else int(input_ids.shape[0])
        model_config = self.vllm_config.model_config
        hidden = torch.zeros(rows, model_config.get_hidden_size(), dtype=model_config.dtype,
                             device=self.vllm_config.device_config.device)
        return output._replace(text_hidden_states=hidden)

    def compute_logits(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        logits = super().compute_logits(hidden_states, *args, **kwargs)
        if logits is not None:
            return logits
        return hidden_states.new_zeros(hidden_states.shape[0], self.vllm_config.model_config.get_vocab_size())
