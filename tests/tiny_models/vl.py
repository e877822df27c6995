"""A tiny Qwen2-VL-shaped model (vision tower + M-RoPE text model) for tests (not shipped).

Random weights, fixed seed, an offline BPE tokenizer carrying Qwen2-VL's vision
tokens and a PIL image processor pinned to one image size, so vLLM's Qwen2-VL
path (HF processor, encoder, M-RoPE positions) runs it without downloads. Text
head size 32 (vLLM's CPU attention needs >= 32); `mrope_section` sums to half of
it. The LM head is scaled up like llama.py's, for clear greedy winners.
"""

from __future__ import annotations

import json
from pathlib import Path

from tests.tiny_models.llama import TINY_CONFIG, build_tokenizer

VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
IMAGE_SIDE = 112  # pixels: 8 x 8 patches of 14, merged 2 x 2 -> 16 image tokens
IMAGE_TOKENS = (IMAGE_SIDE // 14 // 2) ** 2
TEXT_CONFIG = dict(
    vocab_size=TINY_CONFIG["vocab_size"],
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    rms_norm_eps=1e-5,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 6, 6]},
)
VISION_CONFIG = dict(depth=1, embed_dim=32, num_heads=2, mlp_ratio=2, patch_size=14,
                     spatial_merge_size=2, temporal_patch_size=2, in_channels=3)
_STAMP = "omni-tiny-qwen2-vl-v1"
# The vLLM class tests/support/vl_model.py registers (upstream Qwen2-VL, image-only processor).
VLLM_ARCH = "OmniTinyQwen2VLForConditionalGeneration"


def build_tiny_vl(path: str | Path, seed: int = 0, lm_head_scale: float = 8.0,
                  architecture: str | None = None) -> Path:
    """Create (once) a tiny Qwen2-VL checkpoint with its tokenizer and processor in ``path``.

    `architecture` names the vLLM class in config.json (tests register an image-only one:
    tests/support/vl_model.py); transformers loads the weights either way."""
    path = Path(path)
    stamp = path / "omni_tiny.json"
    if stamp.exists() and json.loads(stamp.read_text()).get("stamp") == _STAMP:
        return path
    import torch
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(path, extra_special=VISION_TOKENS)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in VISION_TOKENS}
    torch.manual_seed(seed)
    config = Qwen2VLConfig(
        text_config={**TEXT_CONFIG, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0},
        vision_config={**VISION_CONFIG, "hidden_size": TEXT_CONFIG["hidden_size"]},
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
    )
    model = Qwen2VLForConditionalGeneration(config)
    with torch.no_grad():
        model.lm_head.weight.mul_(lm_head_scale)
    model.save_pretrained(path, safe_serialization=True)
    if architecture:  # save_pretrained writes the transformers class name
        config_file = path / "config.json"
        saved = json.loads(config_file.read_text())
        config_file.write_text(json.dumps({**saved, "architectures": [architecture]}, indent=2))
    _save_processor(path)
    stamp.write_text(json.dumps({"stamp": _STAMP, "seed": seed}))
    return path


def _save_processor(path: Path) -> None:
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    pixels = IMAGE_SIDE * IMAGE_SIDE
    Qwen2VLImageProcessorPil(min_pixels=pixels, max_pixels=pixels).save_pretrained(path)
    # Named as a hub checkpoint names it: vLLM 0.28-0.31 read the image normalization from a
    # processor config only when it names its processor class, else they load transformers' whole
    # processor, whose video half needs torchvision (absent on CPU torch).
    config_file = path / "preprocessor_config.json"
    config = json.loads(config_file.read_text())
    config["processor_class"] = "Qwen2VLProcessor"
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def image_only_processor_class() -> type:
    """Qwen2VLProcessor without its video half: transformers' video processors need
    torchvision, and transformers reads a processor's parts from its __init__ signature."""
    from transformers.models.qwen2_vl import Qwen2VLProcessor

    class ImageOnlyQwen2VLProcessor(Qwen2VLProcessor):
        def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
            super().__init__(image_processor, tokenizer, None, chat_template=chat_template, **kwargs)

    return ImageOnlyQwen2VLProcessor


def vl_prompt(text: str) -> str:
    """A prompt with one image: vLLM expands the single image pad into IMAGE_TOKENS pads."""
    return f"<|vision_start|><|image_pad|><|vision_end|>{text}"


def tiny_image(seed: int = 0):
    """A deterministic IMAGE_SIDE x IMAGE_SIDE RGB image."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (IMAGE_SIDE, IMAGE_SIDE, 3), dtype=np.uint8), "RGB")


BYTE_TOKEN_BASE = 8  # past the tokenizer's special and vision tokens (ids 0..7)
VOICE_TOKEN_BASE = BYTE_TOKEN_BASE + 256


def thinker_prompt(messages: list[dict[str, str]], voice: int) -> tuple[list[int], dict]:
    """The tiny thinker's request for a conversation (omni-serve's three-stage pipeline,
    deploy/speech/tiny-thinker.toml): a voice token, then one token per UTF-8 byte of the messages'
    texts, one line each (stands in for a tokenizer and its chat template; no image); no payload."""
    text = "\n".join(message["content"] for message in messages)
    return [VOICE_TOKEN_BASE + voice] + [BYTE_TOKEN_BASE + b for b in text.encode("utf-8")], {}


def build_tiny_vl_thinker(path: str | Path) -> Path:
    """The tiny Qwen2-VL as the three-stage pipeline's thinker (the vLLM class
    tests/support/vl_model.py registers): what deploy/speech/tiny-thinker.toml builds."""
    return build_tiny_vl(path, architecture=VLLM_ARCH)
