"""A tiny random Qwen3-Omni-MoE checkpoint in the published layout (Qwen/Qwen3-Omni-30B-A3B-Instruct).

The published `config.json` (model_type "qwen3_omni_moe", architectures
["Qwen3OmniMoeForConditionalGeneration"]) has three sections: `thinker_config` (audio encoder,
vision encoder with deepstack layers, and a MoE text model whose `rope_parameters` carry an
interleaved M-RoPE section [24, 20, 20]), `talker_config` (a MoE text model with a shared expert
and the same M-RoPE section, a code predictor, `accept_hidden_layer`, `thinker_hidden_size`, the
codec and speaker ids) and `code2wav_config`; the weights are `thinker.*`, `talker.*` and
`code2wav.*`, experts one by one (`mlp.experts.N.gate_proj`). This builder writes the same
through transformers' own classes (`Qwen3OmniMoeConfig`, `Qwen3OmniMoeForConditionalGeneration`,
seeded random init, `save_pretrained`), every size shrunk (about 50 MB, a few seconds). Token and
codec ids stay the published ones (vllm-omni's Qwen3-Omni code has some of them written in), so
the thinker keeps the published vocabulary size. Fields the published file has that transformers
no longer declares (the vision encoder's `image_size`, the text models' `tie_word_embeddings`,
...) are written too: upstream vLLM reads them. The text tokenizer is the published kind (Qwen2's
byte-level BPE, its 33 added tokens at the published ids 151643..151675, a ChatML chat template)
with no merges and the byte alphabet as its only text tokens (ids 0..255; the ids between are
unused entries), its multimodal tokens named as published (`image_token` "<|image_pad|>", ...). The
multimodal processor vllm-omni's thinker loads for an image (`Qwen3OmniMoeProcessor`: that tokenizer,
Qwen2-VL's image and video processors at the tiny vision tower's patch and merge sizes, Whisper's
feature extractor at its mel bins, the chat template) is built from transformers' classes and saved
beside it where torchvision is installed (transformers' Qwen2-VL video processor is torchvision-only,
and the processor loads it for an image request too); elsewhere it is left out (`omni_tiny.json`
says so, and why).

  python -m tests.tiny_models.qwen3_omni OUT_DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ARCH = "Qwen3OmniMoeForConditionalGeneration"
MODEL_TYPE = "qwen3_omni_moe"
HEAD_DIM = 32
# The published M-RoPE section ([24, 20, 20] for head_dim 128), scaled to head_dim 32: vLLM
# asserts sum(mrope_section) == head_dim // 2.
MROPE_SECTION = [6, 5, 5]
THINKER_ROPE = {"interleaved": True, "mrope_interleaved": True, "mrope_section": MROPE_SECTION,
                "rope_theta": 1000000, "rope_type": "default"}
TALKER_ROPE = {"interleaved": True, "mrope_section": MROPE_SECTION, "rope_theta": 1000000, "rope_type": "default"}
THINKER_HIDDEN = 64
# The thinker layer the talker reads, as published: vllm-omni's thinker -> talker hand-over has the
# key "24" written in (its stage_input_processors/qwen3_omni.py), so the tiny thinker keeps it and
# has one layer past it (published: 48 layers).
ACCEPT_HIDDEN_LAYER = 24
THINKER_LAYERS = ACCEPT_HIDDEN_LAYER + 1
NUM_CODE_GROUPS = 16  # published; vllm-omni's code2wav reshapes its input by 16
# Published special ids (thinker vocabulary, and the talker's codec vocabulary).
TOKEN_IDS = dict(audio_start_token_id=151669, audio_end_token_id=151670, audio_token_id=151675,
                 image_token_id=151655, video_token_id=151656, vision_start_token_id=151652)
CODEC_IDS = dict(codec_pad_id=2148, codec_bos_id=2149, codec_eos_token_id=2150, codec_nothink_id=2155,
                 codec_think_bos_id=2156, codec_think_eos_id=2157)
SPEAKER_IDS = {"chelsie": 2301, "ethan": 2302, "aiden": 2303}
MOE = dict(num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True, mlp_only_layers=[],
           decoder_sparse_step=1, tie_word_embeddings=False, max_position_embeddings=65536)
THINKER = dict(
    audio_config=dict(d_model=32, encoder_layers=1, encoder_attention_heads=2, encoder_ffn_dim=64,
                      output_dim=THINKER_HIDDEN, num_mel_bins=128, downsample_hidden_size=16, n_window=50,
                      n_window_infer=800, conv_chunksize=500, max_source_positions=1500),
    vision_config=dict(depth=2, hidden_size=32, num_heads=2, intermediate_size=64, out_hidden_size=THINKER_HIDDEN,
                       patch_size=16, spatial_patch_size=16, spatial_merge_size=2, temporal_patch_size=2,
                       deepstack_visual_indexes=[1], num_position_embeddings=64, image_size=128, in_chans=3,
                       in_channels=3, tokens_per_second=2, apply_vit_abs_pos_embed=True),
    text_config=dict(vocab_size=152064, hidden_size=THINKER_HIDDEN, intermediate_size=64,
                     num_hidden_layers=THINKER_LAYERS, num_attention_heads=2, num_key_value_heads=1, head_dim=HEAD_DIM,
                     num_experts=4, shared_expert_intermediate_size=0, use_qk_norm=True, rope_parameters=THINKER_ROPE,
                     **MOE),
    position_id_per_seconds=13, seconds_per_chunk=2, user_token_id=872, vision_end_token_id=151653, **TOKEN_IDS,
)
TALKER = dict(
    text_config=dict(vocab_size=3072, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                     num_key_value_heads=1, head_dim=HEAD_DIM, num_experts=4, shared_expert_intermediate_size=32,
                     rope_parameters=TALKER_ROPE, **MOE),
    code_predictor_config=dict(vocab_size=2048, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                               num_attention_heads=2, num_key_value_heads=1, head_dim=HEAD_DIM,
                               num_code_groups=NUM_CODE_GROUPS, layer_types=["full_attention"],
                               rope_parameters={"rope_theta": 1000000, "rope_type": "default"}),
    num_code_groups=NUM_CODE_GROUPS, thinker_hidden_size=THINKER_HIDDEN, accept_hidden_layer=ACCEPT_HIDDEN_LAYER,
    spatial_merge_size=2, speaker_id=SPEAKER_IDS, position_id_per_seconds=13, seconds_per_chunk=2,
    **CODEC_IDS, **TOKEN_IDS,
)
# code2wav's initializer_range raised from the published 0.02 so that the random decoder's waveform
# is not near silence, and kept low enough that it stays inside (-1, 1), where it is not clamped
# (a clamped sample compares equal whatever came before it).
CODE2WAV = dict(codebook_size=2048, codebook_dim=16, hidden_size=32, latent_dim=32, num_attention_heads=2,
                num_key_value_heads=2, intermediate_size=64, num_hidden_layers=1, num_quantizers=NUM_CODE_GROUPS,
                num_semantic_quantizers=1, semantic_codebook_size=4096, vector_quantization_hidden_dimension=16,
                sliding_window=8, upsample_rates=[2, 2], upsampling_ratios=[2, 2], decoder_dim=32,
                max_position_embeddings=8000, initializer_range=0.1)
TOP = dict(enable_audio_output=True, im_start_token_id=151644, im_end_token_id=151645, tts_pad_token_id=151671,
           tts_bos_token_id=151672, tts_eos_token_id=151673, system_token_id=8948, user_token_id=872,
           assistant_token_id=77091)
# The published tokenizer's added tokens, from id 151643 on (the config's ids above are among them).
ADDED_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
                "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
                "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>",
                "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>",
                "<tool_response>", "</tool_response>", "<think>", "</think>", "<|audio_start|>", "<|audio_end|>",
                "<tts_pad>", "<tts_text_bos>", "<tts_text_eod>", "<tts_text_bos_single>", "<|audio_pad|>"]
FIRST_ADDED_ID = 151643
NEWLINE_ID = 198  # "\n" (byte-level "Ċ"): the published id, and this vocabulary's (its sorted byte alphabet)
NOT_SPECIAL = {"<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
               "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>", "<think>", "</think>"}
# The published tokenizer's named multimodal tokens (Qwen3OmniMoeProcessor reads them, and their ids).
NAMED_TOKENS = {"image_token": "<|image_pad|>", "video_token": "<|video_pad|>", "audio_token": "<|audio_pad|>",
                "vision_bos_token": "<|vision_start|>", "vision_eos_token": "<|vision_end|>",
                "audio_bos_token": "<|audio_start|>", "audio_eos_token": "<|audio_end|>"}
VISION = THINKER["vision_config"]
# An image's pixel budget, in merged patches (each (patch x merge)^2 pixels): 1 to 16 of them, i.e. 1 to
# 16 image tokens, which keeps the engines' encoder profiling and a request's prompt small.
MERGED_PATCH_PIXELS = (VISION["patch_size"] * VISION["spatial_merge_size"]) ** 2
VISION_PIXELS = {"shortest_edge": MERGED_PATCH_PIXELS, "longest_edge": 16 * MERGED_PATCH_PIXELS}
CHAT_TEMPLATE = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
                 "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
STAMP = "tiny-qwen3-omni-v3"


def chat_prompt(text_ids: list[int]) -> list[int]:
    """A one-turn chat as the published template writes it, with the published role ids (vllm-omni's
    thinker -> talker hand-over finds the user and assistant turns by them):
    <|im_start|>user\n TEXT <|im_end|>\n<|im_start|>assistant\n."""
    return conversation_prompt([(TOP["user_token_id"], text_ids)])


def conversation_prompt(turns: list[tuple[int, list[int]]]) -> list[int]:
    """`chat_prompt` of (role id, text ids) turns: each <|im_start|>ROLE\n TEXT <|im_end|>\n, then
    <|im_start|>assistant\n."""
    im_start, im_end = TOP["im_start_token_id"], TOP["im_end_token_id"]
    ids = []
    for role, text in turns:
        ids += [im_start, role, NEWLINE_ID] + list(text) + [im_end, NEWLINE_ID]
    return ids + [im_start, TOP["assistant_token_id"], NEWLINE_ID]


def image_chat_prompt(text_ids: list[int]) -> list[int]:
    """`chat_prompt` of a user turn with one image before its text, as the published chat template
    writes an image item: <|vision_start|><|image_pad|><|vision_end|> (vLLM's multimodal processor
    expands the one <|image_pad|> to the image's tokens)."""
    image = [THINKER["vision_start_token_id"], THINKER["image_token_id"], THINKER["vision_end_token_id"]]
    return chat_prompt(image + list(text_ids))


def text_ids(text: str) -> list[int]:
    """The text as this vocabulary tokenizes it (byte-level, no merges: one id per UTF-8 byte, the
    byte's character's place in the sorted byte alphabet)."""
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    place = {ch: i for i, ch in enumerate(sorted(ByteLevel.alphabet()))}
    char = bytes_to_unicode()
    return [place[char[b]] for b in text.encode("utf-8")]


ROLE_IDS = {"system": TOP["system_token_id"], "developer": TOP["system_token_id"], "user": TOP["user_token_id"],
            "assistant": TOP["assistant_token_id"]}  # a developer message is a system message (as OpenAI takes it)


def thinker_prompt(messages: list[dict[str, str]], voice: int) -> tuple[list[int], dict]:
    """omni-serve's thinker request for a conversation (deploy/speech/qwen3-omni-gpu.toml): its chat
    prompt, and the voice as vllm-omni's `speaker` (the talker's speaker ids, in the order the
    config's voices list them)."""
    turns = [(ROLE_IDS[m["role"]], text_ids(m["content"])) for m in messages]
    return conversation_prompt(turns), {"speaker": [list(SPEAKER_IDS)[voice]]}


def config():
    from transformers import Qwen3OmniMoeConfig

    cfg = Qwen3OmniMoeConfig(thinker_config=THINKER, talker_config=TALKER, code2wav_config=CODE2WAV, **TOP)
    cfg.architectures = [ARCH]
    return cfg


def write_tokenizer(path: Path) -> None:
    """vocab.json / merges.txt / tokenizer_config.json as published, then transformers' own save
    (tokenizer.json beside them, so that loading it does not rebuild the vocabulary)."""
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import AutoTokenizer

    alphabet = sorted(ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    vocab.update({f"<|unused{i}|>": i for i in range(len(alphabet), FIRST_ADDED_ID)})
    (path / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False))
    (path / "merges.txt").write_text("#version: 0.2\n")
    added = {str(FIRST_ADDED_ID + i): dict(content=t, lstrip=False, rstrip=False, normalized=False, single_word=False,
                                           special=t not in NOT_SPECIAL) for i, t in enumerate(ADDED_TOKENS)}
    (path / "tokenizer_config.json").write_text(json.dumps(dict(
        tokenizer_class="Qwen2Tokenizer", model_max_length=65536, errors="replace", clean_up_tokenization_spaces=False,
        bos_token=None, eos_token="<|im_end|>", pad_token="<|endoftext|>", unk_token=None, split_special_tokens=False,
        added_tokens_decoder=added, extra_special_tokens=NAMED_TOKENS, chat_template=CHAT_TEMPLATE), indent=1))
    AutoTokenizer.from_pretrained(path).save_pretrained(path)


def write_processor(path: Path) -> str | None:
    """Qwen3OmniMoeProcessor's files beside the tokenizer (written first), from transformers' own
    classes; where it cannot (no torchvision, which Qwen2-VL's video processor needs, or a transformers
    that builds it otherwise), nothing and why: the checkpoint then serves text only."""
    import importlib.util

    if importlib.util.find_spec("torchvision") is None:
        return "no torchvision (transformers' Qwen2-VL video processor needs it)"
    try:
        from transformers import (AutoTokenizer, Qwen2VLImageProcessor, Qwen2VLVideoProcessor, Qwen3OmniMoeProcessor,
                                  WhisperFeatureExtractor)

        grid = dict(patch_size=VISION["patch_size"], merge_size=VISION["spatial_merge_size"],
                    temporal_patch_size=VISION["temporal_patch_size"], size=dict(VISION_PIXELS))
        processor = Qwen3OmniMoeProcessor(
            image_processor=Qwen2VLImageProcessor(**grid), video_processor=Qwen2VLVideoProcessor(**grid),
            feature_extractor=WhisperFeatureExtractor(feature_size=THINKER["audio_config"]["num_mel_bins"]),
            tokenizer=AutoTokenizer.from_pretrained(path), chat_template=CHAT_TEMPLATE)
        processor.save_pretrained(path)
    except Exception as exc:  # the text-only checkpoint stands; the caller reports why
        return f"{type(exc).__name__}: {exc}"
    return None


def build(path: str | Path, seed: int = 0) -> Path:
    import torch
    from transformers import Qwen3OmniMoeForConditionalGeneration

    path = Path(path)
    torch.manual_seed(seed)
    model = Qwen3OmniMoeForConditionalGeneration(config()).to(torch.bfloat16)
    model.save_pretrained(path)
    write_tokenizer(path)
    missing = write_processor(path)
    (path / "omni_tiny.json").write_text(json.dumps({"stamp": STAMP, "seed": seed, "processor": missing is None,
                                                     "processor_missing": missing}))
    return path


if __name__ == "__main__":
    print(build(sys.argv[1]))
