"""Upstream Qwen2-VL with an image-only HF processor, registered with vLLM's ModelRegistry.

transformers' Qwen2VLProcessor always loads a video processor, and transformers'
video processors need torchvision, which the CPU venv lacks (a CUDA torchvision
does not load against CPU torch). The model, its vision encoder, M-RoPE positions
and vLLM's multimodal processor are upstream's; only the HF processor class that
vLLM asks transformers for is one without the video half.
"""

from __future__ import annotations

from transformers.models.qwen2_vl import Qwen2VLProcessor
from vllm.model_executor.models.qwen2_vl import (
    Qwen2VLDummyInputsBuilder,
    Qwen2VLForConditionalGeneration,
    Qwen2VLMultiModalProcessor,
    Qwen2VLProcessingInfo,
)
from vllm.multimodal import MULTIMODAL_REGISTRY

ARCH = "OmniTinyQwen2VLForConditionalGeneration"


class ImageOnlyQwen2VLProcessor(Qwen2VLProcessor):
    """transformers reads a processor's parts from its __init__ signature: no video_processor here."""

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        super().__init__(image_processor, tokenizer, None, chat_template=chat_template, **kwargs)


class ImageOnlyProcessingInfo(Qwen2VLProcessingInfo):
    def get_hf_processor(self, **kwargs: object) -> Qwen2VLProcessor:
        return self.ctx.get_hf_processor(ImageOnlyQwen2VLProcessor, **kwargs)

    def get_supported_mm_limits(self):
        return {"image": None}


@MULTIMODAL_REGISTRY.register_processor(
    Qwen2VLMultiModalProcessor, info=ImageOnlyProcessingInfo, dummy_inputs=Qwen2VLDummyInputsBuilder
)
class OmniTinyQwen2VLForConditionalGeneration(Qwen2VLForConditionalGeneration):
    pass


def register() -> None:
    from vllm import ModelRegistry

    ModelRegistry.register_model(ARCH, OmniTinyQwen2VLForConditionalGeneration)
