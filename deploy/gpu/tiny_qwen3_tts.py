"""A tiny random Qwen3-TTS checkpoint for vllm-omni's own talker class (GPU talker check).

`Qwen3TTSTalkerForConditionalGeneration` (vllm-omni 0.26) loads a Qwen3-TTS model
directory: `config.json` (talker + code predictor + speaker encoder), a text tokenizer,
the weights under their Hugging Face names (`talker.*`, `speaker_encoder.*`) and the
speech tokenizer's encoder in `speech_tokenizer/` (config, feature extractor, weights).
Everything is shrunk to a few MiB. The weights are real random tensors written once
(not `load_format=dummy`), so two engines in two processes load the same model.

The HF names come from vllm-omni's own class: it is built once on this host (any vLLM
platform, CPU included), its parameters get seeded random values, and vLLM's fused
names (`qkv_proj`, `gate_up_proj`, padded vocabularies) are split back into the
checkpoint's. Plain RoPE: the real checkpoint's M-RoPE config needs
`get_mrope_input_positions`, which the class lacks (its three position streams are
equal for codec tokens, so plain RoPE computes the same thing).

  python deploy/gpu/tiny_qwen3_tts.py OUT_DIR     (needs vllm + vllm-omni 0.26 importable)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

ARCH = "Qwen3TTSTalkerForConditionalGeneration"
CODEBOOK = 64  # codes 0..63; the talker's specials follow
TEXT_VOCAB = 256
# Text ids the prompt builder reads: tts pad/bos/eos (never inside a request's text ids).
TTS_PAD, TTS_BOS, TTS_EOS, IM_START, IM_END = 250, 251, 252, 253, 254
TALKER = dict(
    vocab_size=80, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
    num_key_value_heads=2, head_dim=64, hidden_act="silu", max_position_embeddings=1024, rms_norm_eps=1e-6,
    rope_theta=10000, num_code_groups=4, text_hidden_size=64, text_vocab_size=TEXT_VOCAB,
    codec_pad_id=CODEBOOK, codec_bos_id=CODEBOOK + 1, codec_eos_token_id=CODEBOOK + 2,
    codec_think_id=CODEBOOK + 3, codec_nothink_id=CODEBOOK + 4, codec_think_bos_id=CODEBOOK + 5,
    codec_think_eos_id=CODEBOOK + 6, codec_language_id={"english": CODEBOOK + 7}, spk_id={}, spk_is_dialect={},
    code_predictor_config=dict(vocab_size=CODEBOOK, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                               num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                               max_position_embeddings=64, num_code_groups=4, rms_norm_eps=1e-6),
)
SPEAKER_ENCODER = dict(mel_dim=16, enc_dim=32, enc_channels=[16, 16, 16, 16, 48], enc_kernel_sizes=[5, 3, 3, 3, 1],
                       enc_dilations=[1, 2, 3, 4, 1], enc_attention_channels=8, enc_res2net_scale=8,
                       enc_se_channels=8, sample_rate=24000)
SPEECH_TOKENIZER = dict(
    model_type="qwen3_tts_tokenizer_12hz", encoder_valid_num_quantizers=4, input_sample_rate=24000,
    output_sample_rate=24000, decode_upsample_rate=8, encode_downsample_rate=8,
    encoder_config=dict(hidden_size=16, num_filters=4, num_residual_layers=1, upsampling_ratios=[2, 2], kernel_size=3,
                        last_kernel_size=3, residual_kernel_size=3, dilation_growth_rate=2, compress=2,
                        num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2, head_dim=8,
                        intermediate_size=32, codebook_size=16, codebook_dim=8, num_quantizers=4,
                        num_semantic_quantizers=1, sliding_window=16, max_position_embeddings=64,
                        frame_rate=3000.0, sampling_rate=24000, audio_channels=1, upsample_groups=16),
    decoder_config=dict(codebook_size=16, hidden_size=16, latent_dim=16, num_attention_heads=2, num_key_value_heads=2,
                        intermediate_size=32, num_hidden_layers=1, num_quantizers=4, upsample_rates=[2, 2],
                        upsampling_ratios=[2], decoder_dim=16, sliding_window=16),
)
HEAD_SCALE = 8.0  # heads scaled up so greedy argmax has clear winners (as tests/tiny_models/llama.py does)
# vLLM name prefix -> checkpoint prefix (the inverse of the class's hf_to_vllm_mapper)
TO_HF = [("model.embed_tokens.", "talker.model.codec_embedding."), ("model.", "talker.model."),
         ("lm_head.", "talker.codec_head."), ("text_embedding.", "talker.model.text_embedding."),
         ("text_projection.", "talker.text_projection."), ("code_predictor.", "talker.code_predictor."),
         ("speaker_encoder.", "speaker_encoder.")]


def write_configs(path: Path) -> None:
    (path / "speech_tokenizer").mkdir(parents=True, exist_ok=True)
    config = dict(architectures=[ARCH], model_type="qwen3_tts", tts_model_type="voice_design",
                  tokenizer_type="qwen3_tts_tokenizer_12hz", tts_model_size="tiny", torch_dtype="bfloat16",
                  im_start_token_id=IM_START, im_end_token_id=IM_END, tts_pad_token_id=TTS_PAD,
                  tts_bos_token_id=TTS_BOS, tts_eos_token_id=TTS_EOS, talker_config=TALKER,
                  speaker_encoder_config=SPEAKER_ENCODER)
    (path / "config.json").write_text(json.dumps(config, indent=1))
    (path / "speech_tokenizer" / "config.json").write_text(json.dumps(SPEECH_TOKENIZER, indent=1))
    (path / "speech_tokenizer" / "preprocessor_config.json").write_text(json.dumps(dict(
        feature_extractor_type="EncodecFeatureExtractor", feature_size=1, sampling_rate=24000, padding_side="right",
        padding_value=0.0, return_attention_mask=True, chunk_length_s=None, overlap=None)))


def write_tokenizer(path: Path) -> None:
    """A word-level text tokenizer of TEXT_VOCAB ids (the prompt builder loads one even when a
    request brings its text ids precomputed, which the check's requests do)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(TEXT_VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0", pad_token="w0").save_pretrained(path)


def build_vllm_omni_talker(path: Path) -> Any:
    """vllm-omni's talker class built on this host from the configs in `path` (float32)."""
    import vllm_omni  # noqa: F401  (its configs and patches)
    from vllm.config import set_current_vllm_config
    from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment
    from vllm.engine.arg_utils import EngineArgs
    from vllm_omni.engine.arg_utils import register_omni_models_to_vllm
    from vllm_omni.model_executor.models.qwen3_tts.qwen3_tts_talker import Qwen3TTSTalkerForConditionalGeneration

    register_omni_models_to_vllm()
    vllm_config = EngineArgs(model=str(path), skip_tokenizer_init=True, dtype="float32", enforce_eager=True,
                             max_model_len=512).create_engine_config()
    with set_current_vllm_config(vllm_config):
        init_distributed_environment(1, 0, "tcp://127.0.0.1:29533", 0, "gloo")
        ensure_model_parallel_initialized(1, 1)
        return Qwen3TTSTalkerForConditionalGeneration(vllm_config=vllm_config)


def random_state(model: Any, seed: int) -> dict[str, Any]:
    """Seeded values for every parameter (and the speech encoder's codebook buffers)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    out: dict[str, Any] = {}
    for name, p in sorted(model.named_parameters()):
        if name.endswith(("norm.weight", "layernorm.weight", ".scale")) or (p.dim() == 1 and "norm" in name):
            value = torch.ones(p.shape)
        elif p.dim() == 1:
            value = torch.randn(p.shape, generator=gen) * 0.02
        elif "embed" in name:
            value = torch.randn(p.shape, generator=gen)
        else:
            fan_in = p[0].numel()
            value = torch.randn(p.shape, generator=gen) / fan_in ** 0.5
            if name == "lm_head.weight" or name.startswith("code_predictor.lm_head."):
                value *= HEAD_SCALE
        out[name] = value
    for name, b in model.named_buffers():
        if name.startswith("encoder.") and ".codebook." in name:
            out[name] = torch.randn(b.shape, generator=gen) if name.endswith("embed_sum") else torch.ones(b.shape)
    return out


def to_checkpoint(state: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(talker checkpoint, speech tokenizer checkpoint) under the names the class loads, bf16."""
    import torch

    t, heads, kv, hd = TALKER, TALKER["num_attention_heads"], TALKER["num_key_value_heads"], TALKER["head_dim"]
    talker: dict[str, Any] = {}
    speech: dict[str, Any] = {}
    for name, value in state.items():
        value = value.to(torch.bfloat16).contiguous()
        if name.startswith("encoder."):
            speech[name] = value
            continue
        hf = next(new + name[len(old):] for old, new in TO_HF if name.startswith(old))
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            talker[hf] = value[: t["vocab_size"]].clone()  # vLLM pads vocabularies
        elif ".qkv_proj." in name:
            q, k, v = value.split([heads * hd, kv * hd, kv * hd])
            for part, w in (("q_proj", q), ("k_proj", k), ("v_proj", v)):
                talker[hf.replace("qkv_proj", part)] = w.clone()
        elif ".gate_up_proj." in name:
            gate, up = value.chunk(2)
            talker[hf.replace("gate_up_proj", "gate_proj")] = gate.clone()
            talker[hf.replace("gate_up_proj", "up_proj")] = up.clone()
        else:
            talker[hf] = value
    return talker, speech


def build(path: str | Path, seed: int = 0) -> Path:
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    write_configs(path)
    write_tokenizer(path)
    talker, speech = to_checkpoint(random_state(build_vllm_omni_talker(path), seed))
    save_file(talker, str(path / "model.safetensors"))
    save_file(speech, str(path / "speech_tokenizer" / "model.safetensors"))
    (path / "omni_tiny.json").write_text(json.dumps({"stamp": "tiny-qwen3-tts-v1", "seed": seed}))
    return path


if __name__ == "__main__":
    print(build(sys.argv[1]))
