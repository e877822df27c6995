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
    from tests.support.talker_reference import reference_codes
    from tests.tiny_models.code2wav import load_decoder
    from tests.tiny_models.talker import speech_prompt

    prompt, payload = speech_prompt(text, voice)
    info = {"hidden_states": {"output": torch.from_numpy(payload["hidden_states"]["output"])},
            "embed": {"tts_pad": torch.from_numpy(payload["embed"]["tts_pad"])}}
    (ref,) = reference_codes(talker, [{"prompt_token_ids": prompt, "info": info, "max_tokens": max_tokens,
                                       "ignore_eos": True}])
    codes = ref["codes"]
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
