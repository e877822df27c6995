"""Upstream Qwen2-VL with an image-only HF processor, registered with vLLM's ModelRegistry.

The CPU venv has no torchvision (a CUDA torchvision does not load against CPU
torch), and two transformers pieces of Qwen2-VL need it: the video processor,
which transformers' Qwen2VLProcessor always loads, and the module vLLM imports
`smart_resize` from (`image_processing_qwen2_vl`; the PIL module defines the same
function). So that module name is pointed at the PIL module before vLLM's
qwen2_vl is imported, and vLLM asks transformers for a processor class without
the video half. The model, its vision encoder, M-RoPE positions and vLLM's
multimodal processor are upstream's. Import this module before vLLM loads the model
(engine in-process: VLLM_ENABLE_V1_MULTIPROCESSING=0).
"""

from __future__ import annotations

import importlib.util
import sys

from transformers.models.qwen2_vl import Qwen2VLProcessor, image_processing_pil_qwen2_vl

from tests.tiny_models.vl import VLLM_ARCH, image_only_processor_class

if importlib.util.find_spec("torchvision") is None:
    sys.modules.setdefault("transformers.models.qwen2_vl.image_processing_qwen2_vl", image_processing_pil_qwen2_vl)

from vllm.model_executor.models.qwen2_vl import (  # noqa: E402 (after the module alias)
    Qwen2VLDummyInputsBuilder,
    Qwen2VLForConditionalGeneration,
    Qwen2VLMultiModalProcessor,
    Qwen2VLProcessingInfo,
)
from vllm.multimodal import MULTIMODAL_REGISTRY  # noqa: E402

ARCH = VLLM_ARCH
IMAGE_ONLY_PROCESSOR = image_only_processor_class()  # one class: vLLM caches processors by it


class ImageOnlyProcessingInfo(Qwen2VLProcessingInfo):
    def get_hf_processor(self, **kwargs: object) -> Qwen2VLProcessor:
        return self.ctx.get_hf_processor(IMAGE_ONLY_PROCESSOR, **kwargs)

    def get_supported_mm_limits(self):
        return {"image": None}


@MULTIMODAL_REGISTRY.register_processor(
    Qwen2VLMultiModalProcessor, info=ImageOnlyProcessingInfo, dummy_inputs=Qwen2VLDummyInputsBuilder
)
class OmniTinyQwen2VLForConditionalGeneration(Qwen2VLForConditionalGeneration):
    pass


def engine_kwargs() -> dict:
    """vLLM settings the tiny model needs on this install. vLLM 0.31 builds its on-device image
    normalization from transformers' whole processor, whose video half needs torchvision (absent
    beside CPU torch): there the image processor normalizes on the host instead."""
    if importlib.util.find_spec("torchvision") is not None:
        return {}
    try:
        from vllm.model_executor.layers.fusion import mm_input_norm
    except ImportError:  # before 0.31: the norm's parameters come from the processor config
        return {}
    return {"mm_device_do_normalize": False} if hasattr(mm_input_norm, "cached_get_processor") else {}


def register() -> None:
    from vllm import ModelRegistry

    ModelRegistry.register_model(ARCH, OmniTinyQwen2VLForConditionalGeneration)
