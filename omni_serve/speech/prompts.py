"""The first stage's prompt for a speech request, and what it lets a request ask for.

A pipeline file's `speech_prompt` names one of two things:
- a function `(text, voice index) -> (prompt ids, payload)`: the voices are the file's `voices`, a
  request's language stays vllm-omni's "Auto" and its instructions empty (`TextVoicePrompt`);
- a class built with the first stage's spec (its model and engine arguments), which reads what its
  model speaks: a `SpeechPrompt` (omni_serve/speech/qwen3_tts.py: a Qwen3-TTS checkpoint's speakers,
  languages and instructions, as vllm-omni's speech server reads them). The file then names no voices.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

from omni_serve.config import ConfigError, ServeConfig, check_voices, load_callable
from omni_serve.speech.reference import VoiceReference

AUTO_LANGUAGE = "Auto"  # vllm-omni's "the model picks": every model takes it
CUSTOM_VOICE = "CustomVoice"  # vllm-omni's task of a voice by name (its default task_type)
BASE = "Base"  # vllm-omni's task of a voice cloned from a request's reference audio
Prompt = Callable[[str, int], tuple[list[int], dict]]  # text, voice index -> the first stage's prompt ids, payload


class SpeechPrompt(Protocol):
    """What a speech request becomes for the first stage."""

    voices: list[str]  # the voices it speaks, the first the default; none: it takes no voice (a request's is ignored)
    languages: list[str]  # what a request's `language` may name besides "Auto", vllm-omni's title case
    max_instructions_chars: int  # 0: a request's `instructions` must be empty
    instructions_required: bool  # the voice is described in the instructions (vllm-omni's VoiceDesign)
    task_type: str  # vllm-omni's task it serves: a request's `task_type` is this or absent
    clones_voices: bool  # every request brings its voice as reference audio (vllm-omni's Base)
    speaker_embedding_size: int  # a precomputed speaker embedding's width a request may give instead; 0: none

    def __call__(self, text: str, voice: int, language: str, instructions: str,
                 reference: VoiceReference | None = None) -> tuple[list[int], dict[str, Any]]:
        """The prompt ids and payload for `text` in voice `voice` (an index into `voices`), `language`
        ("Auto" or one of `languages`) and `instructions` ("" for none); `reference` the voice to
        clone (given exactly when `clones_voices`)."""
        ...

    def text_tokens(self, text: str, instructions: str) -> int | None:
        """The request's input tokens as its model's server counts them (vllm-omni's usage); None: the
        server counts the first stage's text rows."""
        ...

    def max_frames(self, text: str) -> int | None:
        """The most frames a request of `text` makes when it names no `max_new_tokens` (below the
        pipeline's limit); None: the pipeline's limit alone."""
        ...

    def reference_tokens(self, reference: VoiceReference) -> int:
        """A voice clone's reference as input tokens (vllm-omni's usage: the reference codec frames an
        in-context clone reads; none for the embedding alone)."""
        ...


@dataclass
class TextVoicePrompt:
    """A `speech_prompt` function of the text and the voice: no language but Auto, no instructions."""

    function: Prompt
    voices: list[str]
    languages: list[str] = field(default_factory=list)
    max_instructions_chars: int = 0
    instructions_required: bool = False
    task_type: str = CUSTOM_VOICE
    clones_voices: bool = False
    speaker_embedding_size: int = 0

    def __call__(self, text: str, voice: int, language: str, instructions: str,
                 reference: VoiceReference | None = None) -> tuple[list[int], dict[str, Any]]:
        return self.function(text, voice)

    def text_tokens(self, text: str, instructions: str) -> int | None:
        return None

    def max_frames(self, text: str) -> int | None:
        return None

    def reference_tokens(self, reference: VoiceReference) -> int:
        return 0


def load_speech_prompt(config: ServeConfig) -> SpeechPrompt:
    """The config's `speech_prompt`: a function wrapped, a class built with the first stage's spec."""
    named = load_callable(config.speech_prompt)
    if not inspect.isclass(named):
        return TextVoicePrompt(named, list(config.voices))
    if config.voices_given:
        raise ConfigError(f"{config.path}: voices are {config.speech_prompt}'s (its model's speakers); "
                          "remove the file's voices")
    prompt = named(next(iter(config.stages.values())))
    check_voices(prompt.voices, config.speech_prompt)
    return prompt
