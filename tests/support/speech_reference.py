"""The speech stages run by hand on the tiny models, outside vLLM: what omni-serve's audio must equal.

The talker's direct step-by-step forward (tests/support/talker_reference.py) gives the codes for
`speech_prompt(text, voice)`; the codec's direct forward decodes them chunk by chunk, each chunk
with its left context, the context's samples cut (as omni-code2wav plans it).
"""

from __future__ import annotations

import numpy as np
import torch


def reference_samples(talker: str, code2wav: str, text: str, voice: int, max_tokens: int, chunk: int,
                      left: int) -> np.ndarray:
    from tests.tiny_models.talker import speech_prompt

    prompt, payload = speech_prompt(text, voice)
    return talker_code2wav_samples(talker, code2wav, prompt, payload, max_tokens, chunk, left)


def thinker_reference_samples(thinker: str, talker: str, code2wav: str, text: str, voice: int, thinker_tokens: int,
                              max_tokens: int, chunk: int, left: int) -> np.ndarray:
    """The three stages by hand: the thinker's greedy tokens and hidden rows from a direct
    transformers forward, the talker's request made from them (`thinker_talker_prompt`), then
    the talker and the codec as above."""
    from omni_serve.speech.handover import HIDDEN, ThinkerOutput
    from tests.tiny_models.talker import thinker_talker_prompt
    from tests.tiny_models.vl import thinker_prompt

    prompt_ids, payload = thinker_prompt([{"role": "user", "content": text}], voice)
    rows, output_ids = thinker_rows(thinker, prompt_ids, thinker_tokens)
    prompt, payload = thinker_talker_prompt(ThinkerOutput({HIDDEN: rows}, prompt_ids, output_ids, thinker, payload))
    return talker_code2wav_samples(talker, code2wav, prompt, payload, max_tokens, chunk, left)


def thinker_rows(thinker: str, prompt_ids: list[int], max_tokens: int) -> tuple[np.ndarray, list[int]]:
    """The tiny thinker's last-layer hidden rows (final norm applied, as vLLM's model returns them)
    for its prompt and every greedy token but the last (what omni-thinker assembles), and its
    greedy tokens."""
    from transformers import Qwen2VLForConditionalGeneration

    model = Qwen2VLForConditionalGeneration.from_pretrained(thinker, dtype=torch.float32).eval()
    ids = list(prompt_ids)
    with torch.no_grad():
        for _ in range(max_tokens):
            seq = torch.tensor([ids])
            ids.append(int(model(input_ids=seq, attention_mask=torch.ones_like(seq)).logits[0, -1].argmax()))
        seq = torch.tensor([ids[:-1]])
        out = model(input_ids=seq, attention_mask=torch.ones_like(seq), output_hidden_states=True)
    return out.hidden_states[-1][0].numpy(), ids[len(prompt_ids):]


def speech_codes(talker: str, text: str, voice: int, max_tokens: int) -> torch.Tensor:
    """The talker's codes [frames, Q] for `speech_prompt(text, voice)`, by its direct forward."""
    from tests.tiny_models.talker import speech_prompt

    prompt, payload = speech_prompt(text, voice)
    return talker_codes(talker, prompt, payload, max_tokens)


def talker_codes(talker: str, prompt: list[int], payload: dict, max_tokens: int) -> torch.Tensor:
    from tests.support.talker_reference import reference_codes

    info = {"hidden_states": {"output": torch.from_numpy(payload["hidden_states"]["output"])},
            "embed": {"tts_pad": torch.from_numpy(payload["embed"]["tts_pad"])}}
    (ref,) = reference_codes(talker, [{"prompt_token_ids": prompt, "info": info, "max_tokens": max_tokens,
                                       "ignore_eos": True}])
    return ref["codes"]


def talker_code2wav_samples(talker: str, code2wav: str, prompt: list[int], payload: dict, max_tokens: int,
                            chunk: int, left: int) -> np.ndarray:
    from tests.tiny_models.code2wav import load_decoder

    codes = talker_codes(talker, prompt, payload, max_tokens)
    decoder = load_decoder(code2wav)
    spf, parts = decoder.samples_per_frame, []
    with torch.no_grad():
        for start in range(0, codes.shape[0], chunk):
            first = max(0, start - left)
            parts.append(decoder(codes[first:start + chunk].t().unsqueeze(0))[0][(start - first) * spf:])
    return torch.cat(parts).numpy()


def pcm16(samples: np.ndarray) -> np.ndarray:
    """What the server sends for them: 16-bit, clipped to [-1, 1]."""
    return (np.clip(samples, -1, 1) * 32767.0).round().astype(np.int16)
