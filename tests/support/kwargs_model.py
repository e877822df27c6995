"""A Llama whose forward takes vllm-omni's extra kwargs, registered with vLLM's ModelRegistry.

Upstream Llama takes no extra forward kwargs, so the extra-kwargs seam needs a
model that does. This one records, per forward, what it got for every batch
row (the request's tag, its token span, the positions and token ids there) into
the JSON-lines file named by $OMNI_KWARGS_LOG, then runs upstream Llama.
"""

from __future__ import annotations

import json
import os

import torch
from vllm.model_executor.models.llama import LlamaForCausalLM

ARCH = "OmniKwargsLlamaForCausalLM"


class OmniKwargsLlamaForCausalLM(LlamaForCausalLM):
    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate_tensors=None,
        inputs_embeds: torch.Tensor | None = None,
        runtime_additional_information: list[dict] | None = None,
        request_token_spans: list[list[int]] | None = None,
    ):
        if runtime_additional_information is not None:
            rows = []
            for info, (start, end) in zip(runtime_additional_information, request_token_spans):
                ref = info.get("codes", {}).get("ref")
                rows.append({
                    "tag": info.get("meta", {}).get("tag"),
                    "span": [start, end],
                    "position": int(positions[start]),
                    "input_ids": input_ids[start:end].tolist() if input_ids is not None else None,
                    "ref_sum": float(ref.sum()) if isinstance(ref, torch.Tensor) else None,
                    "processed": info.get("meta", {}).get("num_processed_tokens", 0),
                })
            with open(os.environ["OMNI_KWARGS_LOG"], "a") as f:
                f.write(json.dumps(rows) + "\n")
        return super().forward(input_ids, positions, intermediate_tensors, inputs_embeds)


def register() -> None:
    from vllm import ModelRegistry

    ModelRegistry.register_model(ARCH, OmniKwargsLlamaForCausalLM)
