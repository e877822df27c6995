"""Tiny, deterministic models for tests, the demo and the benchmarks (not shipped).

No model can be downloaded on CI machines, so the demo and the end-to-end
tests build a random-weight Llama (and an offline BPE tokenizer) with a fixed
seed. Head size is 32 because vLLM's CPU attention needs head_dim >= 32; the
LM head is scaled up so greedy decoding has clear winners instead of near-ties
that flip between numerically different (but equivalent) code paths.
"""

from __future__ import annotations

import json
from pathlib import Path

_CORPUS = (
    "the quick brown fox jumps over the lazy dog . a sidecar hosts the omni hooks "
    "while the shim hosts the upstream model runner . every step they exchange small "
    "messages and tensors travel through shared arenas . thinker talker code to wave "
    "audio text speech hidden states embeddings tokens prompts outputs requests "
)
TINY_CONFIG = dict(
    vocab_size=384,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
)
_STAMP = "omni-tiny-llama-v1"


def build_tiny_llama(path: str | Path, seed: int = 0, lm_head_scale: float = 8.0) -> Path:
    """Create (once) a tiny Llama checkpoint with a tokenizer in ``path``."""
    path = Path(path)
    stamp = path / "omni_tiny.json"
    if stamp.exists() and json.loads(stamp.read_text()).get("stamp") == _STAMP:
        return path
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    config = LlamaConfig(**TINY_CONFIG, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight.mul_(lm_head_scale)
    model.save_pretrained(path, safe_serialization=True)
    build_tokenizer(path)
    stamp.write_text(json.dumps({"stamp": _STAMP, "seed": seed}))
    return path


def build_tokenizer(path: Path, extra_special: list[str] | tuple[str, ...] = ()):
    """Train the offline BPE tokenizer on the corpus, save it in ``path`` and return it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TINY_CONFIG["vocab_size"],
        special_tokens=["<pad>", "<s>", "</s>", "<unk>", *extra_special],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator([_CORPUS] * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
    )
    fast.save_pretrained(path)
    return fast
