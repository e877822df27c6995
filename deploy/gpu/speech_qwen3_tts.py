"""omni-serve's speech prompt for vllm-omni's own Qwen3-TTS talker (deploy/gpu/speech_serving.py).

The request vllm-omni 0.26's speech server sends its talker for a CustomVoice request
(`OmniOpenAIServingSpeech._build_tts_params` and `_build_qwen3_tts_request`, read, not imported:
that module needs vllm-omni's patches): the text and the speaker as strings in
`additional_information` (the talker tokenizes them itself), and `[1] * n` as the prompt, n from
vllm-omni's own `Qwen3TTSPromptEmbedsBuilder.estimate_prompt_len_from_additional_information`
(imported with vllm-omni's package stood in: no patch), with the model's tokenizer.

The model directory comes from OMNI_SPEECH_QWEN3_TTS_MODEL (omni-serve calls a speech prompt with
the text and the voice's index only); the voices are VOICES, in the pipeline config's order.
"""

from __future__ import annotations

import functools
import os
from typing import Any

MODEL_ENV = "OMNI_SPEECH_QWEN3_TTS_MODEL"
# CustomVoice speakers the bench adds to the tiny checkpoint (speech_serving.with_speakers): codec
# ids past the tiny talker's specials (64..71), inside its vocabulary of 80.
VOICES = {"vivian": 72, "ryan": 73}
PLACEHOLDER = 1  # vllm-omni's placeholder prompt id


@functools.cache
def _model() -> tuple[Any, Any, Any]:
    from transformers import AutoConfig, AutoTokenizer

    from worker_shim.omni_models.registration import register_vllm_omni_models

    register_vllm_omni_models()  # stands vllm-omni's package in, registers its config class
    from vllm_omni.model_executor.models.qwen3_tts.prompt_embeds_builder import Qwen3TTSPromptEmbedsBuilder

    path = os.environ[MODEL_ENV]
    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=True, padding_side="left")
    talker_config = AutoConfig.from_pretrained(path, trust_remote_code=True).talker_config
    return Qwen3TTSPromptEmbedsBuilder, tokenizer, talker_config


def tts_params(text: str, voice: str) -> dict[str, Any]:
    """vllm-omni's `_build_tts_params` for {"input": text, "voice": voice} (a built-in speaker)."""
    return {"text": [text], "task_type": ["CustomVoice"], "language": ["Auto"], "speaker": [voice],
            "voice_created_at": [0], "instruct": [""]}


def speech_prompt(text: str, voice: int) -> tuple[list[int], dict[str, Any]]:
    builder, tokenizer, talker_config = _model()
    params = tts_params(text, list(VOICES)[voice])
    n = builder.estimate_prompt_len_from_additional_information(
        additional_information=params, task_type="CustomVoice",
        tokenize_prompt=lambda t: tokenizer(t, padding=False)["input_ids"],
        codec_language_id=getattr(talker_config, "codec_language_id", None),
        spk_is_dialect=getattr(talker_config, "spk_is_dialect", None), estimate_ref_code_len=None)
    return [PLACEHOLDER] * n, params
