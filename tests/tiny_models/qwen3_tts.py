"""A tiny random Qwen3-TTS checkpoint in the published layout, for vllm-omni's own classes.

The published Qwen3-TTS checkpoints (Qwen/Qwen3-TTS-12Hz-*) hold: `config.json` (talker with
its M-RoPE section, code predictor, speaker encoder), `generation_config.json`, a byte-level
BPE text tokenizer (`vocab.json`, `merges.txt`, `tokenizer_config.json`),
`preprocessor_config.json`, `model.safetensors` (`talker.*`, `speaker_encoder.*`) and
`speech_tokenizer/` (`config.json` with encoder and decoder configs, `configuration.json`,
`preprocessor_config.json`, `model.safetensors` with `encoder.*` and `decoder.*`). This
builder writes the same files with every size shrunk (a few MiB). The weights are real
random tensors written once (not `load_format=dummy`), so engines in several processes, and
a direct call of the class, load the same model.

The names come from vllm-omni's own classes: the talker (`Qwen3TTSTalkerForConditionalGeneration`,
which also holds the speaker encoder and the speech tokenizer's encoder) and the code2wav
stage (`Qwen3TTSCode2Wav`, the speech tokenizer's decoder) are built once on this host (any
vLLM platform, CPU included) through the shim's loader (worker_shim/omni_models/: no
vllm-omni patch), their parameters get seeded random values, and vLLM's fused names
(`qkv_proj`, `gate_up_proj`, padded vocabularies) are split back into the checkpoint's.

  python -m tests.tiny_models.qwen3_tts OUT_DIR [--base]   (vllm + an installed vllm-omni importable;
                                                            --base: a Base checkpoint, `build_base`)
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

ARCH = "Qwen3TTSTalkerForConditionalGeneration"
CODE2WAV_ARCH = "Qwen3TTSCode2Wav"  # the second stage: the same directory, this architecture
CODEBOOK = 64  # codes 0..63; the talker's specials follow
TEXT_VOCAB = 256  # the byte-level alphabet: every text tokenizes, no merges
# Text ids the prompt builder reads: tts pad/bos/eos (never inside a request's text ids).
TTS_PAD, TTS_BOS, TTS_EOS, IM_START, IM_END = 250, 251, 252, 253, 254
HEAD_DIM = 64
# The published talker's M-RoPE section ([24, 20, 20] for head_dim 128), scaled to head_dim 64:
# vLLM asserts sum(mrope_section) == head_dim // 2.
MROPE_SECTION = [12, 10, 10]
TALKER = dict(
    vocab_size=80, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
    num_key_value_heads=2, head_dim=HEAD_DIM, hidden_act="silu", max_position_embeddings=1024, rms_norm_eps=1e-6,
    rope_theta=1000000, rope_scaling={"interleaved": True, "mrope_section": MROPE_SECTION, "rope_type": "default"},
    position_id_per_seconds=13, use_cache=True, attention_bias=False, attention_dropout=0.0,
    num_code_groups=4, text_hidden_size=64, text_vocab_size=TEXT_VOCAB,
    codec_pad_id=CODEBOOK, codec_bos_id=CODEBOOK + 1, codec_eos_token_id=CODEBOOK + 2,
    codec_think_id=CODEBOOK + 3, codec_nothink_id=CODEBOOK + 4, codec_think_bos_id=CODEBOOK + 5,
    codec_think_eos_id=CODEBOOK + 6, codec_language_id={"english": CODEBOOK + 7}, spk_id={}, spk_is_dialect={},
    code_predictor_config=dict(vocab_size=CODEBOOK, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                               num_attention_heads=2, num_key_value_heads=1, head_dim=32, hidden_act="silu",
                               max_position_embeddings=64, num_code_groups=4, rms_norm_eps=1e-6, rope_theta=1000000,
                               rope_scaling=None, layer_types=["full_attention"], use_sliding_window=False),
)
SPEAKER_ENCODER = dict(mel_dim=16, enc_dim=32, enc_channels=[16, 16, 16, 16, 48], enc_kernel_sizes=[5, 3, 3, 3, 1],
                       enc_dilations=[1, 2, 3, 4, 1], enc_attention_channels=8, enc_res2net_scale=8,
                       enc_se_channels=8, sample_rate=24000)
SPEECH_TOKENIZER = dict(
    architectures=["Qwen3TTSTokenizerV2Model"], model_type="qwen3_tts_tokenizer_12hz", encoder_valid_num_quantizers=4,
    input_sample_rate=24000, output_sample_rate=24000, decode_upsample_rate=8, encode_downsample_rate=8,
    encoder_config=dict(hidden_size=16, num_filters=4, num_residual_layers=1, upsampling_ratios=[2, 2], kernel_size=3,
                        last_kernel_size=3, residual_kernel_size=3, dilation_growth_rate=2, compress=2,
                        num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2, head_dim=8,
                        intermediate_size=32, codebook_size=16, codebook_dim=8, num_quantizers=4,
                        num_semantic_quantizers=1, sliding_window=16, max_position_embeddings=64,
                        frame_rate=3000.0, sampling_rate=24000, audio_channels=1, upsample_groups=16),
    # codebook_dim: read by the decoder, passed through the config class's **kwargs (as published).
    decoder_config=dict(codebook_size=CODEBOOK, codebook_dim=16, hidden_size=16, latent_dim=16, num_attention_heads=2,
                        num_key_value_heads=2, head_dim=8, intermediate_size=32, num_hidden_layers=1,
                        num_quantizers=4, upsample_rates=[2, 2], upsampling_ratios=[2], decoder_dim=16,
                        sliding_window=16, max_position_embeddings=1024, rms_norm_eps=1e-5,
                        layer_scale_initial_scale=0.01, rope_theta=10000, attention_bias=False,
                        attention_dropout=0.0, hidden_act="silu"),
)
FEATURE_EXTRACTOR = dict(feature_extractor_type="EncodecFeatureExtractor", feature_size=1, sampling_rate=24000,
                         padding_side="right", padding_value=0.0, return_attention_mask=True, chunk_length_s=None,
                         overlap=None)
HEAD_SCALE = 8.0  # heads scaled up so greedy argmax has clear winners (as tests/tiny_models/llama.py does)
# vLLM name prefix -> checkpoint prefix (the inverse of the class's hf_to_vllm_mapper)
TO_HF = [("model.embed_tokens.", "talker.model.codec_embedding."), ("model.", "talker.model."),
         ("lm_head.", "talker.codec_head."), ("text_embedding.", "talker.model.text_embedding."),
         ("text_projection.", "talker.text_projection."), ("code_predictor.", "talker.code_predictor."),
         ("speaker_encoder.", "speaker_encoder.")]
SPEECH_TOKENIZER_PREFIXES = ("encoder.", "decoder.")
# The decoder's matrices scaled down so that its waveform stays mostly inside (-1, 1), where it
# is not clamped (a clamped sample compares equal whatever came before it).
DECODER_SCALE = 0.5  # speech_tokenizer/model.safetensors
STAMP = "tiny-qwen3-tts-v2"


def write_configs(path: Path, kind: str = "voice_design", speaker_encoder: dict | None = None,
                  speech_tokenizer: dict | None = None) -> None:
    (path / "speech_tokenizer").mkdir(parents=True, exist_ok=True)
    config = dict(architectures=[ARCH], model_type="qwen3_tts", tts_model_type=kind,
                  tokenizer_type="qwen3_tts_tokenizer_12hz", tts_model_size="tiny", torch_dtype="bfloat16",
                  im_start_token_id=IM_START, im_end_token_id=IM_END, tts_pad_token_id=TTS_PAD,
                  tts_bos_token_id=TTS_BOS, tts_eos_token_id=TTS_EOS, talker_config=TALKER,
                  speaker_encoder_config=speaker_encoder or SPEAKER_ENCODER)
    (path / "config.json").write_text(json.dumps(config, indent=1))
    (path / "generation_config.json").write_text(json.dumps(dict(
        do_sample=True, temperature=0.9, top_k=50, top_p=1.0, repetition_penalty=1.05, subtalker_dosample=True,
        subtalker_temperature=0.9, subtalker_top_k=50, subtalker_top_p=1.0, max_new_tokens=256), indent=1))
    (path / "preprocessor_config.json").write_text(json.dumps(FEATURE_EXTRACTOR, indent=1))
    (path / "speech_tokenizer" / "config.json").write_text(json.dumps(speech_tokenizer or SPEECH_TOKENIZER, indent=1))
    (path / "speech_tokenizer" / "configuration.json").write_text(json.dumps({"framework": "pytorch",
                                                                             "task": "feature-extraction"}))
    (path / "speech_tokenizer" / "preprocessor_config.json").write_text(json.dumps(FEATURE_EXTRACTOR, indent=1))


def write_tokenizer(path: Path) -> None:
    """A byte-level BPE tokenizer of TEXT_VOCAB ids and no merges, in the published files
    (`vocab.json`, `merges.txt`, `tokenizer_config.json`): the prompt builder loads one even
    when a request brings its text ids precomputed, which the checks' requests do."""
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = sorted(ByteLevel.alphabet())
    (path / "vocab.json").write_text(json.dumps({ch: i for i, ch in enumerate(alphabet)}, ensure_ascii=False))
    (path / "merges.txt").write_text("#version: 0.2\n")
    (path / "tokenizer_config.json").write_text(json.dumps(dict(
        tokenizer_class="Qwen2Tokenizer", model_max_length=1024, errors="replace", clean_up_tokenization_spaces=False,
        unk_token=None, bos_token=None, eos_token=alphabet[IM_END], pad_token=alphabet[TTS_PAD]), indent=1))


def build_vllm_omni_models(path: Path) -> tuple[Any, Any]:
    """vllm-omni's talker and code2wav classes built on this host from the configs in `path`
    (float32), loaded through the shim's loader (no vllm-omni patch; VLLM_PLUGINS keeps vllm-omni's
    own entry point out of this process)."""
    os.environ.setdefault("VLLM_PLUGINS", "omni_sidecar_shim")
    from vllm.config import set_current_vllm_config
    from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader.utils import get_model_architecture

    from worker_shim.omni_models.patches import require_unpatched
    from worker_shim.omni_models.registration import register_vllm_omni_models

    register_vllm_omni_models()
    models = []
    for arch in (ARCH, CODE2WAV_ARCH):
        vllm_config = EngineArgs(model=str(path), skip_tokenizer_init=True, dtype="float32", enforce_eager=True,
                                 max_model_len=512, hf_overrides={"architectures": [arch]}).create_engine_config()
        with set_current_vllm_config(vllm_config):
            if not models:
                # A world of one; the port the kernel picks (two checkpoints may be built at once).
                init_distributed_environment(1, 0, f"tcp://127.0.0.1:{_open_port()}", 0, "gloo")
                ensure_model_parallel_initialized(1, 1)
            cls, _ = get_model_architecture(vllm_config.model_config)
            models.append(cls(vllm_config=vllm_config))
    require_unpatched("building the tiny Qwen3-TTS checkpoint")
    return models[0], models[1]


def _open_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def random_state(model: Any, seed: int) -> dict[str, Any]:
    """Seeded values for every parameter (and the speech tokenizer's codebook buffers)."""
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
    for name, b in sorted(model.named_buffers()):
        if name.startswith(SPEECH_TOKENIZER_PREFIXES) and ".codebook." in name:
            out[name] = torch.randn(b.shape, generator=gen) if name.endswith("embed_sum") else torch.ones(b.shape)
    return out


def to_checkpoint(state: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(talker checkpoint, speech tokenizer checkpoint) under the names the classes load, bf16."""
    import torch

    t = TALKER
    talker: dict[str, Any] = {}
    speech: dict[str, Any] = {}
    for name, value in state.items():
        value = value.to(torch.bfloat16).contiguous()
        if name.startswith(SPEECH_TOKENIZER_PREFIXES):
            speech[name] = value
            continue
        hf = next(new + name[len(old):] for old, new in TO_HF if name.startswith(old))
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            talker[hf] = value[: t["vocab_size"]].clone()  # vLLM pads vocabularies
        elif ".qkv_proj." in name:
            attn = t["code_predictor_config"] if name.startswith("code_predictor.") else t
            q_rows, kv_rows = (attn[k] * attn["head_dim"] for k in ("num_attention_heads", "num_key_value_heads"))
            q, k, v = value.split([q_rows, kv_rows, kv_rows])
            for part, w in (("q_proj", q), ("k_proj", k), ("v_proj", v)):
                talker[hf.replace("qkv_proj", part)] = w.clone()
        elif ".gate_up_proj." in name:
            gate, up = value.chunk(2)
            talker[hf.replace("gate_up_proj", "gate_proj")] = gate.clone()
            talker[hf.replace("gate_up_proj", "up_proj")] = up.clone()
        else:
            talker[hf] = value
    return talker, speech


# A CustomVoice checkpoint's speakers and languages (codec ids past the specials, inside the vocabulary
# of 80): what the published CustomVoice config.json holds, in its shape (spk_is_dialect: false or the
# dialect's language).
CUSTOM_VOICES = {"ryan": CODEBOOK + 9, "vivian": CODEBOOK + 8, "eric": CODEBOOK + 10}
CUSTOM_LANGUAGES = {"english": CODEBOOK + 7, "german": CODEBOOK + 11, "chinese": CODEBOOK + 12,
                    "sichuan_dialect": CODEBOOK + 13}
CUSTOM_DIALECTS = {"vivian": False, "ryan": False, "eric": "sichuan_dialect"}


def build_custom_voice(path: str | Path, seed: int = 0) -> Path:
    """The tiny checkpoint as a CustomVoice one (the same weights: speakers and languages are codec ids)."""
    path = build(path, seed)
    config = json.loads((path / "config.json").read_text())
    config["tts_model_type"] = "custom_voice"
    config["talker_config"].update(spk_id=CUSTOM_VOICES, codec_language_id=CUSTOM_LANGUAGES,
                                   spk_is_dialect=CUSTOM_DIALECTS)
    (path / "config.json").write_text(json.dumps(config, indent=1))
    return path


# A Base (voice-cloning) checkpoint's speaker encoder takes vllm-omni's 128-band mel spectrogram and
# gives the talker's hidden size, as the published one; its codec encoder makes 12.5 frames a second
# of reference audio (24 kHz / 1920, as published), so a reference of a second or more fits the prompt,
# and quantizes in its codebooks' width (Mimi's default, 256, is the published codebooks').
BASE_SPEAKER_ENCODER = {**SPEAKER_ENCODER, "mel_dim": 128, "enc_dim": TALKER["hidden_size"]}
BASE_SPEECH_TOKENIZER = {**SPEECH_TOKENIZER, "encode_downsample_rate": 1920,
                         "encoder_config": {**SPEECH_TOKENIZER["encoder_config"], "upsampling_ratios": [8, 6, 5, 4],
                                            "frame_rate": 12.5, "vector_quantization_hidden_dimension": 8}}


def build_base(path: str | Path, seed: int = 0) -> Path:
    """The tiny checkpoint as a Base one: no speakers, its voice cloned from a request's reference audio."""
    return build(path, seed, kind="base", speaker_encoder=BASE_SPEAKER_ENCODER, speech_tokenizer=BASE_SPEECH_TOKENIZER)


def build(path: str | Path, seed: int = 0, **configs: Any) -> Path:
    """`configs`: write_configs' (another kind of checkpoint)."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    write_configs(path, **configs)
    write_tokenizer(path)
    talker_model, code2wav_model = build_vllm_omni_models(path)
    state = random_state(talker_model, seed)
    state.update({name: value * (DECODER_SCALE if value.dim() > 1 else 1.0)
                  for name, value in random_state(code2wav_model, seed + 1).items() if name.startswith("decoder.")})
    talker, speech = to_checkpoint(state)
    save_file(talker, str(path / "model.safetensors"))
    save_file(speech, str(path / "speech_tokenizer" / "model.safetensors"))
    (path / "omni_tiny.json").write_text(json.dumps({"stamp": STAMP, "seed": seed}))
    return path


if __name__ == "__main__":
    print(build_base(sys.argv[1]) if "--base" in sys.argv[2:] else build(sys.argv[1]))
