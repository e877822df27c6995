"""`POST /v1/chat/completions` for a pipeline with a thinker: its text and its speech, shaped as
vllm-omni's chat endpoint shapes them for its omni models (its `OmniOpenAIServingChat`, read, not
imported), so a client written for vllm-omni's server reads the same JSON here.

- `modalities` (vllm-omni's): "text", "audio" or both (none given: both). Text is the thinker's
  tokens detokenized by its checkpoint's tokenizer; audio is what /v1/audio/speech would make of
  the same prompt. Text only: the thinker runs alone.
- The voice: vllm-omni's top-level `voice` (or `speaker`), else OpenAI's `audio.voice` when it names
  one of ours; the format: `audio.format`, wav (the default), pcm (pcm16 its alias), flac, mp3 or opus.
- Sampling, as vllm-omni takes it: OpenAI's sampling fields (THINKER_SAMPLING) over the thinker's
  pipeline-file sampling; vllm-omni's `sampling_params_list`, an entry per stage in order, over those
  (merged, where vllm-omni replaces: the pipeline's own fields stay; a stage's max_tokens at most its
  limit; code2wav decodes, it does not sample: its entry is checked and has no effect).
- A whole answer: one choice per modality, both index 0, as vllm-omni answers: the text in
  `choices[0].message.content`, the audio base64 in `message.audio.data` of the next.
- A streamed answer (SSE): `chat.completion.chunk`s with vllm-omni's `modality` field: the text's
  deltas as the thinker makes them, then each chunk of audio base64 in `delta.content` (each chunk
  encoded on its own, a WAV of its own for wav, as vllm-omni does), the last chunk with the finish
  reason; the usage chunk if `stream_options.include_usage` (and every text chunk's usage so far with
  `continuous_usage_stats`, as vLLM adds it; audio chunks carry the prompt's, as vllm-omni's); `data: [DONE]`.
The bodies are plain dicts in OpenAI's shape: vLLM's response classes move between its minors
(0.26's `vllm.entrypoints.openai.engine.protocol` is 0.32's `vllm.entrypoints.serve`).
"""

from __future__ import annotations

import asyncio
import base64
import json
import time
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator, Protocol

import numpy as np

from omni_serve.api import audio
from omni_serve.api.protocol import (CHAT_FORMATS, MODALITIES, THINKER_SAMPLING, ChatAudio, ChatMessage, ChatRequest,
                                     Refused, StageSampling, ThinkerPrompt, check_prompt_length, error_body,
                                     unsupported_fields, validated, voice_index)
from omni_serve.config import ServeConfig
from omni_serve.speech.pipeline import SAMPLING_REFUSALS, SpeechJob, StageFailed, stage_sampling

AUDIO_EXPIRES_S = 24 * 3600  # message.audio.expires_at: vllm-omni's 24 hours (nothing is kept here)


class Tokenizer(Protocol):
    def decode(self, token_ids: list[int], skip_special_tokens: bool = ...) -> str: ...


@dataclass
class ChatInput:
    """A validated chat request: what the pipeline runs and how the answer is shaped."""

    job: SpeechJob
    modalities: tuple[str, ...]
    audio_format: str  # ours: one of audio.FORMATS (unchecked, maybe "", when no audio is asked for)
    stream: bool
    include_usage: bool
    continuous_usage: bool = False  # every chunk's usage so far (vLLM's continuous_usage_stats)


def message_text(message: ChatMessage, index: int) -> str:
    """A message's text: its string, or its text parts one line each; any other part is refused."""
    if message.content is None or isinstance(message.content, str):
        return message.content or ""
    texts = []
    for part in message.content:
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise Refused(f"messages.{index}.content: only text parts are supported here (got a "
                          f"{part.get('type')!r} part)", param=f"messages.{index}.content")
        texts.append(part["text"])
    return "\n".join(texts)


def chat_input(body: bytes, config: ServeConfig, prompt: ThinkerPrompt,
               max_prompt_tokens: int | None = None, vocab_sizes: dict[str, int] | None = None) -> ChatInput:
    """A chat request checked against the schema and this server's model (`max_prompt_tokens`: the
    thinker engine's, `vocab_sizes`: each stage engine's; None: unchecked); `Refused` says why not."""
    request = validated(body, ChatRequest, config)
    if not request.messages:
        raise Refused("messages is empty", param="messages")
    modalities = tuple(request.modalities or MODALITIES)
    unknown = sorted(set(modalities) - set(MODALITIES))
    if unknown:
        raise Refused(f"unsupported output modalities {', '.join(unknown)}; supported: {', '.join(MODALITIES)}",
                      param="modalities")
    refused = unsupported_fields(request, {}) + [f"messages.{i}.{name}" for i, m in enumerate(request.messages)
                                                 for name in unsupported_fields(m, {})]
    if request.stream_options is not None:
        refused += [f"stream_options.{name}" for name in unsupported_fields(request.stream_options, {})]
    if refused:
        raise Refused(f"not supported by this server: {', '.join(refused)}", param=refused[0])
    if request.stream_options is not None and not request.stream:
        raise Refused("stream_options needs stream=true", param="stream_options")
    messages = [{"role": m.role, "content": message_text(m, i)} for i, m in enumerate(request.messages)]
    chars = sum(len(m["content"]) for m in messages)
    if not any(m["content"].strip() for m in messages):
        raise Refused("messages hold no text", param="messages")
    if chars > config.max_input_chars:
        raise Refused(f"messages have {chars} characters; at most {config.max_input_chars}", param="messages")
    audio_options = request.audio or ChatAudio()
    voice = voice_index(request.voice or audio_voice(audio_options.voice, config), config, "voice")
    audio_format = CHAT_FORMATS.get(audio_options.format, "")
    if "audio" in modalities and not audio_format:
        raise Refused(f"audio format {audio_options.format!r} is not supported; supported: {', '.join(CHAT_FORMATS)}",
                      param="audio.format")
    encoding_problem = audio.encoding_problem(audio_format, config.sample_rate) if "audio" in modalities else None
    if encoding_problem:
        raise Refused(encoding_problem.replace("response_format", "audio format"), param="audio.format")
    thinker = config.stages["thinker"]
    max_text_tokens = request.max_completion_tokens or request.max_tokens or thinker.max_tokens
    if max_text_tokens > thinker.max_tokens:
        raise Refused(f"max_tokens {max_text_tokens} is above this server's limit of {thinker.max_tokens}",
                      param="max_completion_tokens" if request.max_completion_tokens else "max_tokens")
    max_frames = config.stages["talker"].max_tokens
    sampling = {"thinker": {name: value for name in THINKER_SAMPLING
                            if (value := getattr(request, name)) is not None and value != []}}
    # vllm-omni's sampling_params_list: each entry over what the top-level fields asked, its max_tokens too
    # (at most the stage's limit: vllm-omni's example clients send their own model's, thousands).
    for stage, entry in stage_entries(request.sampling_params_list, config):
        if entry.max_tokens is not None and stage == "thinker":
            max_text_tokens = min(entry.max_tokens, thinker.max_tokens)
        elif entry.max_tokens is not None and stage == "talker":
            max_frames = min(entry.max_tokens, max_frames)
        sampling[stage] = {**sampling.get(stage, {}), **entry.fields()}
    limits = {"thinker": max_text_tokens, "talker": max_frames}
    for index, stage in enumerate(config.stages):
        if stage not in limits:
            continue
        requested = sampling.get(stage, {})  # none too: its max_tokens may be below the stage's min_tokens
        param = (f"sampling_params_list.{index}" if index < len(request.sampling_params_list or ())
                 else next(iter(requested), "max_tokens"))
        check_sampling(stage, config, request.seed, requested, limits[stage], param, (vocab_sizes or {}).get(stage))
    prompt_ids, payload = prompt(messages, voice)
    check_prompt_length(prompt_ids, max_prompt_tokens, "messages")
    job = SpeechJob(f"chatcmpl-{uuid.uuid4().hex}", prompt_ids, payload, max_frames, request.seed,
                    input_tokens=len(prompt_ids), speak="audio" in modalities, max_text_tokens=max_text_tokens,
                    sampling={stage: fields for stage, fields in sampling.items() if fields and stage in limits})
    stream_options = request.stream_options
    include_usage = bool(stream_options and stream_options.include_usage)
    # vLLM's rule: continuous usage only with the final usage asked for too.
    continuous = include_usage and bool(stream_options and stream_options.continuous_usage_stats)
    return ChatInput(job, modalities, audio_format, request.stream, include_usage, continuous)


def audio_voice(voice: str | None, config: ServeConfig) -> str | None:
    """OpenAI's `audio.voice` when it names one of this server's voices, else None (the default voice):
    vllm-omni reads the voice from `voice` / `speaker` only, and OpenAI's SDK asks for `audio.voice`
    with OpenAI's voices ("alloy", ...), which name none of a model's speakers."""
    try:
        voice_index(voice, config)
    except Refused:
        return None
    return voice


def stage_entries(entries: list[StageSampling] | None, config: ServeConfig) -> list[tuple[str, StageSampling]]:
    """vllm-omni's `sampling_params_list`: (stage, its entry), in the stages' order; fewer entries than
    stages leave the rest the pipeline file's."""
    if not entries:
        return []
    stages = list(config.stages)
    if len(entries) > len(stages):
        raise Refused(f"sampling_params_list has {len(entries)} entries; this pipeline has {len(stages)} stages "
                      f"({', '.join(stages)})", param="sampling_params_list")
    return list(zip(stages, entries))


def check_sampling(stage: str, config: ServeConfig, seed: int | None, requested: dict[str, Any], max_tokens: int,
                   param: str, vocab_size: int | None = None) -> None:
    """The stage's request sampling, as the pipeline will make it, passes vLLM's own checks, those its
    engine makes against the model too (`vocab_size`: its engine's; None: unchecked); else `Refused`."""
    try:
        params = stage_sampling(config.stages[stage].sampling, seed, requested, max_tokens, None)
    except SAMPLING_REFUSALS as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise Refused(f"the {stage}'s sampling: {first}", param=param) from None
    outside = [token for token in params.stop_token_ids or () if vocab_size is not None and token >= vocab_size]
    if outside:
        raise Refused(f"the {stage}'s sampling: stop_token_ids {outside[:8]} are outside its vocabulary of "
                      f"{vocab_size} tokens", param=param)


def chat_usage(job: SpeechJob) -> dict[str, int]:
    """OpenAI's usage: the thinker's prompt and the tokens it made."""
    made = len(job.text_ids)
    return {"prompt_tokens": job.input_tokens, "completion_tokens": made, "total_tokens": job.input_tokens + made}


def encoded_audio(samples: np.ndarray, audio_format: str, rate: int) -> str:
    return base64.b64encode(audio.encoded(samples, audio_format, rate)).decode("ascii")


def completion(got: ChatInput, text: str | None, samples: np.ndarray | None, model: str, rate: int) -> dict[str, Any]:
    """The whole answer (`chat.completion`): a text choice, an audio choice, as the modalities ask."""
    created = int(time.time())
    choices = []
    if text is not None:
        choices.append({"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                        "finish_reason": got.job.text_finish or "stop", "stop_reason": None})
    if samples is not None:
        spoken = {"id": f"audio-{uuid.uuid4().hex[:16]}", "data": encoded_audio(samples, got.audio_format, rate),
                  "expires_at": created + AUDIO_EXPIRES_S, "transcript": ""}
        choices.append({"index": 0, "message": {"role": "assistant", "content": None, "audio": spoken},
                        "logprobs": None, "finish_reason": "stop", "stop_reason": None})
    return {"id": got.job.request_id, "object": "chat.completion", "created": created, "model": model,
            "choices": choices, "usage": chat_usage(got.job)}


class TextDeltas:
    """The thinker's tokens as text, delta by delta (vLLM's incremental detokenizing: each step
    decodes only from a few tokens back); a token that ends inside a UTF-8 character waits for
    the next."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix_at = 0  # where the decoded window starts
        self.read_at = 0  # tokens before this are sent

    def _text(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def add(self, delta: list[int]) -> str:
        self.ids += delta
        prefix = self._text(self.ids[self.prefix_at:self.read_at])
        text = self._text(self.ids[self.prefix_at:])
        if len(text) <= len(prefix) or text.endswith("\ufffd"):
            return ""
        self.prefix_at, self.read_at = self.read_at, len(self.ids)
        return text[len(prefix):]

    def rest(self) -> str:
        """What is left unsent at the end (an incomplete character, as the tokenizer writes it)."""
        prefix = self._text(self.ids[self.prefix_at:self.read_at])
        text = self._text(self.ids[self.prefix_at:])
        self.prefix_at = self.read_at = len(self.ids)
        return text[len(prefix):]


Part = list[int] | np.ndarray  # a chat answer's part from the pipeline: the thinker's token delta, or audio


async def chat_sse(got: ChatInput, first: Part | None, parts: AsyncIterator[Part], deltas: TextDeltas, model: str,
                   rate: int) -> AsyncIterator[str]:
    """The streamed answer from the pipeline's parts (`first`, taken before the status line, then the rest)."""
    created = int(time.time())
    prompt_usage = {"prompt_tokens": got.job.input_tokens, "completion_tokens": 0,
                    "total_tokens": got.job.input_tokens}

    made = 0  # the thinker's tokens so far (continuous usage)

    def chunk(modality: str, delta: dict[str, Any], **extra: Any) -> dict[str, Any]:
        return {"id": got.job.request_id, "object": "chat.completion.chunk", "created": created, "model": model,
                "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}],
                "modality": modality, **extra}

    def text_chunk(delta: dict[str, Any]) -> dict[str, Any]:
        if not got.continuous_usage:
            return chunk("text", delta)
        usage = {"prompt_tokens": got.job.input_tokens, "completion_tokens": made,
                 "total_tokens": got.job.input_tokens + made}
        return chunk("text", delta, usage=usage)

    def data(payload: dict[str, Any]) -> str:
        return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"

    # Each chunk goes out when the next is made, so that the last one can carry the finish reason.
    texting = "text" in got.modalities
    pending = text_chunk({"role": "assistant", "content": ""}) if texting else None

    async def every_part() -> AsyncIterator[Part]:
        if first is not None:
            yield first
        async for part in parts:
            yield part

    try:
        async for part in every_part():
            if isinstance(part, list):
                made += len(part)
                text = deltas.add(part) if texting else ""
                if text:
                    yield data(pending)
                    pending = text_chunk({"content": text})
                continue
            if texting:
                texting, text = False, deltas.rest()
                if text:
                    yield data(pending)
                    pending = text_chunk({"content": text})
            if part.size == 0:
                continue
            if pending is not None:
                yield data(pending)
            # vllm-omni's audio chunks: the role in each delta, usage with the prompt's tokens only.
            # Off the event loop: an MP3 or Opus chunk takes a while, and other streams wait on the loop.
            content = await asyncio.to_thread(encoded_audio, part, got.audio_format, rate)
            pending = chunk("audio", {"role": "assistant", "content": content}, usage=prompt_usage)
        if texting and (text := deltas.rest()):
            yield data(pending)
            pending = text_chunk({"content": text})
        if pending is not None:
            last = pending["choices"][0]
            last["finish_reason"] = (got.job.text_finish or "stop") if pending["modality"] == "text" else "stop"
            yield data(pending)
        if got.include_usage:
            yield data({"id": got.job.request_id, "object": "chat.completion.chunk", "created": created,
                        "model": model, "choices": [], "usage": chat_usage(got.job)})
    except StageFailed as exc:  # the status line is out: the error as the stream's last event, as vLLM does
        if pending is not None:
            yield data(pending)
        yield data(error_body(f"the speech pipeline failed this request: {exc}", 503))
    finally:
        await parts.aclose()
    yield "data: [DONE]\n\n"
