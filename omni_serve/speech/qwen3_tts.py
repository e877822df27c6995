"""A Qwen3-TTS checkpoint's speech prompt, as vllm-omni's speech server makes it.

`speech_prompt = "omni_serve.speech.qwen3_tts:Qwen3TTSPrompt"` with vllm-omni's own talker and
code2wav classes as the stages (omni_serve/pipelines/qwen3-tts.toml). Built with the talker stage's spec,
it reads that checkpoint as vllm-omni's server does (`_load_supported_speakers`,
`_load_supported_languages`): the voices are `talker_config.spk_id`'s speakers, the languages
`codec_language_id`'s, title-cased; a request that names no voice gets vllm-omni's default speaker.
A VoiceDesign checkpoint (config.json's `tts_model_type` "voice_design") has no speakers: a request
describes the voice in `instructions` (required, as vllm-omni requires them) and names none (one it
names is ignored, as vllm-omni ignores it). A Base checkpoint ("base") clones the voice of a request's
reference audio (`ref_audio`, with its transcript `ref_text` unless `x_vector_only_mode`): the audio
reaches the talker as vllm-omni's server hands it over (`[[samples, rate]]`; its talker makes the
speaker embedding and, in context mode, the reference codes, which the code2wav stage then decodes
as the answer's left context). A request becomes vllm-omni's talker request
(`_build_tts_params`, read, not imported: that module needs vllm-omni's patches): the text, speaker
(lowercased, as vllm-omni's check leaves it), language and instructions as strings in the payload's
`additional_information` (the talker tokenizes them itself), and `[1] * n` as the prompt, n from
vllm-omni's own `Qwen3TTSPromptEmbedsBuilder.estimate_prompt_len_from_additional_information`
(imported with vllm-omni's package stood in: no patch) with the checkpoint's tokenizer.
A Base request may give the voice as its speaker embedding instead (`speaker_embedding`, the talker's width:
vllm-omni's `voice_clone_prompt`). Voices uploaded for cloning are omni_serve/speech/voices.py's.
"""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path
from typing import Any

import numpy as np

from omni_serve.config import ConfigError, StageSpec
from omni_serve.speech.prompts import BASE, CUSTOM_VOICE
from omni_serve.speech.reference import VoiceReference

VOICE_DESIGN = "VoiceDesign"  # vllm-omni's task for a voice described in the instructions
VOICE_DESIGN_MODEL = "voice_design"  # config.json's tts_model_type of those checkpoints
BASE_MODEL = "base"  # config.json's tts_model_type of the voice-cloning checkpoints
SPEECH_TOKENIZER_CONFIG = "speech_tokenizer/config.json"  # its codec's frame rate (vllm-omni's capabilities)
PLACEHOLDER = 1  # vllm-omni's placeholder prompt id
DEFAULT_VOICE = "vivian"  # vllm-omni's speaker for a CustomVoice request that names none
MAX_INSTRUCTIONS_CHARS = 500  # vllm-omni's default (_TTS_MAX_INSTRUCTIONS_LENGTH)
# vllm-omni's ceiling on a Base answer that names no max_new_tokens (a cloned voice may never reach the
# codec's EOS): this many frames a token of the text, and never fewer than the floor.
BASE_FRAMES_PER_TEXT_TOKEN, BASE_MIN_FRAMES = 12, 192


class Qwen3TTSPrompt:
    """The talker stage's checkpoint's task, voices, languages and prompts (omni_serve/speech/prompts.py's
    SpeechPrompt)."""

    max_instructions_chars = MAX_INSTRUCTIONS_CHARS

    def __init__(self, stage: StageSpec) -> None:
        from transformers import AutoConfig, AutoTokenizer

        from worker_shim.omni_models.package import install_stand_in, installed_folder, is_stand_in
        from worker_shim.omni_models.registration import register_vllm_omni_models
        from worker_shim.upstream.compat import QWEN3_TTS_MODEL_TYPE, VLLM_OMNI_PACKAGE

        if installed_folder() is None:
            raise ConfigError("Qwen3TTSPrompt needs vllm-omni installed beside vLLM (its Qwen3-TTS classes)")
        install_stand_in()  # vllm-omni's modules without its __init__ and patches, in this process too
        if not is_stand_in(sys.modules.get(VLLM_OMNI_PACKAGE)):
            raise ConfigError("vllm-omni's package was imported for real in omni-serve (its patches with it); "
                              "start omni-serve with VLLM_PLUGINS=omni_sidecar_shim")
        register_vllm_omni_models()  # its config class, for AutoConfig
        from vllm_omni.model_executor.models.qwen3_tts.prompt_embeds_builder import Qwen3TTSPromptEmbedsBuilder

        trust = bool(stage.engine.get("trust_remote_code", False))
        try:
            config = AutoConfig.from_pretrained(stage.model, trust_remote_code=trust,
                                                revision=stage.engine.get("revision"))
            self._tokenizer = AutoTokenizer.from_pretrained(stage.engine.get("tokenizer") or stage.model,
                                                            trust_remote_code=trust, padding_side="left",
                                                            revision=stage.engine.get("tokenizer_revision"))
        except (OSError, ValueError) as exc:  # not found, not reachable, not a checkpoint transformers reads
            raise ConfigError(f"cannot read {stage.model}: {str(exc).splitlines()[0]}") from None
        if getattr(config, "model_type", None) != QWEN3_TTS_MODEL_TYPE:
            raise ConfigError(f"{stage.model} is a {getattr(config, 'model_type', '?')!r} checkpoint, not Qwen3-TTS "
                              f"(model_type {QWEN3_TTS_MODEL_TYPE!r})")
        talker = config.talker_config
        speakers = dict(getattr(talker, "spk_id", None) or {})
        kind = getattr(config, "tts_model_type", "")
        self.clones_voices = kind == BASE_MODEL
        # A precomputed speaker embedding joins the talker's codec embeddings: its width (vllm-omni's check).
        self.speaker_embedding_size = int(talker.hidden_size) if self.clones_voices else 0
        self._codec_frame_rate = 0.0
        if kind == VOICE_DESIGN_MODEL:
            self.task_type, self.instructions_required, self.voices = VOICE_DESIGN, True, []
        elif self.clones_voices:
            if importlib.util.find_spec("soundfile") is None:
                raise ConfigError(f"{stage.model} clones voices from reference audio, which needs soundfile "
                                  "(pip install soundfile)")
            self.task_type, self.instructions_required, self.voices = BASE, False, []
            self._codec_frame_rate = codec_frame_rate(stage, talker)
        elif speakers:
            self.task_type, self.instructions_required = CUSTOM_VOICE, False
            # The default voice first: vllm-omni's, Vivian, where the checkpoint has her (as the published ones do).
            self.voices = sorted((str(name) for name in speakers), key=lambda name: name.lower() != DEFAULT_VOICE)
        else:
            raise ConfigError(f"{stage.model} is a Qwen3-TTS {kind or '?'} checkpoint without built-in speakers: "
                              "this server serves CustomVoice, VoiceDesign and Base checkpoints")
        self._language_ids = dict(getattr(talker, "codec_language_id", None) or {})
        self.languages = sorted(str(language).title() for language in self._language_ids)
        self._dialects = dict(getattr(talker, "spk_is_dialect", None) or {})
        self._builder = Qwen3TTSPromptEmbedsBuilder

    def additional_information(self, text: str, voice: int, language: str, instructions: str,
                               reference: VoiceReference | None = None) -> dict[str, Any]:
        """vllm-omni's `_build_tts_params` for a request of a built-in speaker (CustomVoice), of a voice
        its instructions describe (VoiceDesign, no speaker) or of its reference audio (Base; vllm-omni's
        `build`: the audio resolved to `[[samples, rate]]`, the reference codes' length estimated)."""
        info: dict[str, Any] = {"text": [text], "task_type": [self.task_type], "language": [language]}
        if self.voices:
            info.update(speaker=[self.voices[voice].lower()], voice_created_at=[0])
        info["instruct"] = [instructions]
        if reference is not None:
            if not reference.x_vector_only:
                info["ref_text"] = [reference.text]
            info["x_vector_only_mode"] = [reference.x_vector_only]
            if reference.voice is not None:  # vllm-omni names an uploaded voice: its talker caches the voice's codes
                info.update(speaker=[reference.voice[0]], voice_created_at=[reference.voice[1]])
            if reference.speaker_embedding is not None:  # vllm-omni's precomputed voice: the embedding alone
                info["voice_clone_prompt"] = [{"ref_spk_embedding": reference.speaker_embedding.tolist()}]
            if reference.audio is not None:
                info["ref_code_length"] = [self._reference_frames(reference.audio, reference.sample_rate)]
                info["ref_audio"] = [[reference.audio.tolist(), reference.sample_rate]]
        return info

    def __call__(self, text: str, voice: int, language: str, instructions: str,
                 reference: VoiceReference | None = None) -> tuple[list[int], dict[str, Any]]:
        if self.clones_voices and reference is None:
            raise ValueError("a Base checkpoint's request brings its reference audio")
        info = self.additional_information(text, voice, language, instructions, reference)
        n = self._builder.estimate_prompt_len_from_additional_information(
            additional_information=info, task_type=self.task_type, tokenize_prompt=self._tokens,
            codec_language_id=self._language_ids, spk_is_dialect=self._dialects, estimate_ref_code_len=None)
        return [PLACEHOLDER] * n, info

    def text_tokens(self, text: str, instructions: str) -> int:
        """vllm-omni's usage (`qwen3_tts_input_token_details`): the text's tokens and the instructions'."""
        return len(self._tokens(text)) + (len(self._tokens(instructions)) if instructions.strip() else 0)

    def max_frames(self, text: str) -> int | None:
        """vllm-omni's Base ceiling (its adapter's `apply_sampling_overrides`): frames in proportion to the
        text's tokens; other tasks: the pipeline's limit. An answer cut there is served as made (vllm-omni
        0.30 fails it as incomplete)."""
        if not self.clones_voices:
            return None
        return max(BASE_MIN_FRAMES, len(self._tokens(text)) * BASE_FRAMES_PER_TEXT_TOKEN)

    def reference_tokens(self, reference: VoiceReference) -> int:
        """vllm-omni's usage (`gate_audio_tokens`): an in-context clone's reference codec frames, as estimated
        for its prompt; none for the speaker embedding alone."""
        if reference.x_vector_only or reference.audio is None:
            return 0
        return self._reference_frames(reference.audio, reference.sample_rate)

    def _reference_frames(self, audio: np.ndarray, sample_rate: int) -> int:
        """The codec frames a reference makes (vllm-omni's `ref_code_length` estimate)."""
        return math.ceil(int(audio.shape[0]) / sample_rate * self._codec_frame_rate)

    def _tokens(self, text: str) -> list[int]:
        return self._tokenizer(text, padding=False)["input_ids"]


def codec_frame_rate(stage: StageSpec, talker: Any) -> float:
    """Codec frames a second of reference audio makes, as vllm-omni's server reads it: the speech
    tokenizer's output rate over its encoder's downsampling, else the talker's positions a second."""
    from transformers.utils import cached_file

    try:
        path = cached_file(stage.model, SPEECH_TOKENIZER_CONFIG, revision=stage.engine.get("revision"),
                           _raise_exceptions_for_missing_entries=False)
        codec = json.loads(Path(path).read_text()) if path else {}
        return float(codec["output_sample_rate"]) / float(codec["encode_downsample_rate"])
    except (OSError, ValueError, KeyError, TypeError, ZeroDivisionError):
        rate = float(getattr(talker, "position_id_per_seconds", 0) or 0)
        if rate <= 0:
            raise ConfigError(f"{stage.model}: no codec frame rate in {SPEECH_TOKENIZER_CONFIG} or the talker's "
                              "position_id_per_seconds (a Base checkpoint needs one)") from None
        return rate
