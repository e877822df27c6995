"""The speech and chat requests, with vllm-omni's field names (its `OpenAICreateSpeechRequest`, read,
not imported: that module cannot be imported without vllm-omni's package and its patches; for chat,
OpenAI's fields with vllm-omni's `modalities` and top-level `voice`/`speaker`, which it reads as
extras of vLLM's `ChatCompletionRequest`), so a client written for vllm-omni's server sends the same
JSON here. vLLM's `ChatCompletionRequest` itself is not used: of its sampling fields this server
honours those vllm-omni applies to the thinker, and none of its tool fields. Fields this server cannot
honour are refused with a 400 naming them, never silently dropped.
"""

from __future__ import annotations

import json
import math
import re
from typing import Annotated, Any, Callable, Literal, TypeVar

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, ValidationError, field_validator

from omni_serve.api.audio import FORMATS
from omni_serve.config import ServeConfig

_INT64_MAX = 2**63 - 1
TokenId = Annotated[int, Field(ge=0, le=_INT64_MAX)]
M = TypeVar("M", bound=BaseModel)


class SpeechRequest(BaseModel):
    model_config = ConfigDict(extra="allow")  # vllm-omni's other fields: refused below when set

    input: str
    model: str | None = None
    voice: str | None = Field(default=None, validation_alias=AliasChoices("voice", "speaker"))
    instructions: str | None = None
    response_format: str = "wav"
    sample_rate: int | None = Field(default=None, gt=0)
    speed: float | None = Field(default=1.0, ge=0.25, le=4.0)
    stream_format: Literal["sse", "audio"] | None = None
    stream: bool = False
    task_type: Literal["CustomVoice", "VoiceDesign", "Base"] | None = None
    language: str | None = None
    ref_audio: str | list[str] | None = None
    ref_text: str | None = None
    x_vector_only_mode: bool | None = None
    speaker_embedding: list[float] | list[list[float]] | None = None
    max_new_tokens: int | None = Field(default=None, ge=1, le=_INT64_MAX)
    seed: int | None = Field(default=None, ge=-(2**63), le=_INT64_MAX)
    initial_codec_chunk_frames: int | None = Field(default=None, ge=0, le=_INT64_MAX)
    non_streaming_mode: bool | None = None
    extra_params: dict[str, Any] | None = None
    # vLLM's benchmark client sends it with --ignore-eos (vllm-omni ignores it): here vLLM's ignore_eos on
    # the talker's request (the pipeline file's stop_token_ids still end it).
    ignore_eos: bool | None = None

    @field_validator("voice", mode="before")
    @classmethod
    def _voice_id(cls, voice: Any) -> Any:
        if isinstance(voice, dict):
            if "id" not in voice:
                raise ValueError("voice dict must contain 'id'")
            return voice["id"]
        return voice


MAX_BATCH_ITEMS = 32  # vllm-omni's default (its engine's tts_batch_max_items)


class BatchSpeechFields(BaseModel):
    """vllm-omni's batch speech fields (its `BatchSpeechRequest` and `SpeechBatchItem`, their types checked
    for the whole batch as there): the batch's are each item's unless the item sets its own."""

    model_config = ConfigDict(extra="allow")  # others: refused by name when set (batch_items)

    voice: str | None = Field(default=None, validation_alias=AliasChoices("voice", "speaker"))
    instructions: str | None = None
    response_format: Literal[FORMATS] | None = None  # one of audio.FORMATS' names
    speed: float | None = Field(default=None, ge=0.25, le=4.0)
    task_type: Literal["CustomVoice", "VoiceDesign", "Base"] | None = None
    language: str | None = None
    ref_audio: str | None = None
    ref_text: str | None = None
    x_vector_only_mode: bool | None = None
    max_new_tokens: int | None = Field(default=None, ge=1, le=_INT64_MAX)
    initial_codec_chunk_frames: int | None = Field(default=None, ge=0, le=_INT64_MAX)
    non_streaming_mode: bool | None = None


class SpeechBatchItem(BatchSpeechFields):
    input: str


class SpeechBatchRequest(BatchSpeechFields):
    model: str | None = None
    items: list[SpeechBatchItem] = Field(min_length=1, max_length=MAX_BATCH_ITEMS)


def batch_items(body: bytes, config: ServeConfig) -> list[dict[str, Any]]:
    """A batch's items, each a speech request's fields (the batch's under the item's own; a whole answer
    each); `Refused` for the batch as a whole. An item's own faults are its answer's, not the batch's."""
    batch = validated(body, SpeechBatchRequest, config)
    refused = unsupported_fields(batch, {}) + [
        f"items.{index}.{name}" for index, item in enumerate(batch.items) for name in unsupported_fields(item, {})]
    if refused:
        raise Refused(f"not a batch speech field: {', '.join(refused)}", param=refused[0])
    shared = batch.model_dump(exclude_none=True, exclude=set(batch.model_extra or ()) | {"items"})
    return [{**shared, **item.model_dump(exclude_none=True, exclude=set(item.model_extra or ()))}
            for item in batch.items]


class SamplingFields(BaseModel):
    """The SamplingParams fields a chat request's top level and vllm-omni's `sampling_params_list` both
    take (vllm-omni's overrides of its comprehension stage), typed: an engine's own decoder would fail
    on a mistyped one. `stop` strings are not among them: the stages make ids, the front end detokenizes."""

    temperature: float | None = Field(default=None, ge=0)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=-1, le=_INT64_MAX)
    min_tokens: int | None = Field(default=None, ge=0)
    ignore_eos: bool | None = None
    stop_token_ids: list[TokenId] | None = None
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)


class StageSampling(SamplingFields):
    """An entry of vllm-omni's `sampling_params_list`: the SamplingParams fields its clients send.
    Others are refused by name."""

    model_config = ConfigDict(extra="forbid")

    min_p: float | None = Field(default=None, ge=0, le=1)
    max_tokens: int | None = Field(default=None, ge=1, le=_INT64_MAX)  # at most the stage's limit
    seed: int | None = Field(default=None, ge=-(2**63), le=_INT64_MAX)
    repetition_penalty: float | None = Field(default=None, gt=0)
    n: int | None = Field(default=None, ge=1, le=1)  # one answer per request
    detokenize: bool | None = None  # the pipeline's own (its stages make ids): taken, not used

    def fields(self) -> dict[str, Any]:
        """The fields set, less those the pipeline sets itself (max_tokens: the caller's) and `n`."""
        return {k: v for k, v in self.model_dump(exclude_none=True).items()
                if k not in ("max_tokens", "detokenize", "n")}


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, tool_calls, ...: refused when set

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[dict[str, Any]] | None = None


class ChatAudio(BaseModel):
    """OpenAI's `audio` output option."""

    model_config = ConfigDict(extra="forbid")

    voice: str | None = None
    format: str = "wav"  # vllm-omni's default

    @field_validator("voice", mode="before")
    @classmethod
    def _voice_id(cls, voice: Any) -> Any:
        return SpeechRequest._voice_id(voice)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")

    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False  # vLLM's: usage on every chunk too (with include_usage)


class ChatRequest(SamplingFields):  # SamplingFields: the thinker's, over the pipeline file's
    model_config = ConfigDict(extra="allow")  # OpenAI's and vLLM's other fields: refused below when set

    messages: list[ChatMessage]
    model: str | None = None
    modalities: list[str] | None = None  # None or empty: all the pipeline makes (vllm-omni's default)
    audio: ChatAudio | None = None
    voice: str | None = Field(default=None, validation_alias=AliasChoices("voice", "speaker"))  # vllm-omni's
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(default=None, ge=1, le=_INT64_MAX)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=_INT64_MAX)
    seed: int | None = Field(default=None, ge=-(2**63), le=_INT64_MAX)
    n: int | None = Field(default=1, ge=1, le=1)
    user: str | None = None  # OpenAI's end-user id: nothing to do with it here
    # vllm-omni's: one stage's sampling per entry, in the stages' order (its example clients send it).
    sampling_params_list: list[StageSampling] | None = None

    @field_validator("voice", mode="before")
    @classmethod
    def _voice_id(cls, voice: Any) -> Any:
        return SpeechRequest._voice_id(voice)


THINKER_SAMPLING = tuple(SamplingFields.model_fields)  # a chat request's top-level sampling: the thinker's
MODALITIES = ("text", "audio")  # what a pipeline with a thinker makes (its text; its talker's audio)
# the request's audio format -> ours (vllm-omni's alias pcm16)
CHAT_FORMATS = {"wav": "wav", "pcm": "pcm", "pcm16": "pcm", "flac": "flac", "mp3": "mp3", "opus": "opus"}


def unsupported_fields(request: BaseModel, honoured: dict[str, Any] | None = None) -> list[str]:
    """Fields set to something this server cannot honour (unknown ones included); `honoured`: known
    fields and the one value each is honoured at (the speech request's by default)."""
    named = [name for name, default in (UNSUPPORTED if honoured is None else honoured).items()
             if getattr(request, name) not in (default if isinstance(default, tuple) else (default,))]
    # Unset: null, false, empty ({}), or OpenAI's own default for the field (clients that send every
    # default keep working); any other value is set, 0 too (`0 in (None, False)` would take it for false).
    extra = [name for name, value in (request.model_extra or {}).items()
             if value is not None and value is not False and not (isinstance(value, (dict, list)) and not value)
             and not (name in OPENAI_DEFAULTS and value == OPENAI_DEFAULTS[name] and not isinstance(value, bool))]
    return named + sorted(extra)


# OpenAI's defaults for sampling fields a request has no field for (the speech request's: its sampling is
# the pipeline file's): sent as these, they ask for nothing; any other value is refused by name.
OPENAI_DEFAULTS: dict[str, float] = {"temperature": 1, "top_p": 1, "presence_penalty": 0, "frequency_penalty": 0}


# Accepted for a vllm-omni client's sake, but this server's models take none of them: set to
# anything but their default (or one of the values a tuple names), a 400 names the field.
UNSUPPORTED = {
    "ref_audio": None, "ref_text": None,
    # x_vector_only_mode false: voice cloning with its in-context part, which a request without
    # reference audio does not reach either way.
    "x_vector_only_mode": (None, False), "speaker_embedding": None, "extra_params": None, "non_streaming_mode": None,
    "speed": (1.0, None), "initial_codec_chunk_frames": None,  # the first chunk is the code2wav sidecar's option here
}
# A voice-cloning model's requests (vllm-omni's Base) take its reference fields.
CLONING_FIELDS_HONOURED = {name: default for name, default in UNSUPPORTED.items()
                           if name not in ("ref_audio", "ref_text", "x_vector_only_mode", "speaker_embedding")}


class Refused(ValueError):
    """A request this server answers with a 4xx and one message."""

    def __init__(self, message: str, status: int = 400, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.param = param


def error_body(message: str, status: int, param: str | None = None) -> dict[str, Any]:
    """OpenAI's error object."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


ThinkerPrompt = Callable[[list[dict[str, str]], int], tuple[list[int], dict]]  # messages, voice index -> the same


Body = bytes | dict[str, Any]  # a request's JSON, or the object it holds (a batch item, a WebSocket message's)


# Where a decoded JSON text may hold a lone surrogate: only an escape (no UTF encoding holds one).
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def json_object(raw: bytes | str, what: str = "the body") -> dict[str, Any]:
    """A request's JSON object, read strictly: NaN and Infinity (Python's extension) are not JSON, and
    every string is Unicode text (an escaped lone surrogate, which no UTF-8 holds and no tokenizer
    takes, is refused where it is). `Refused` says why not."""
    try:
        text = raw.decode(json.detect_encoding(raw)) if isinstance(raw, bytes) else raw  # UTF-8, -16 or -32, as json
        value = json.loads(text, parse_constant=_not_json, parse_float=_finite)
    except (ValueError, RecursionError) as exc:  # RecursionError: nested too deep
        raise Refused(f"{what} is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise Refused(f"{what} must be a JSON object")
    if _SURROGATE_ESCAPE.search(text):
        where = _lone_surrogate(value)
        if where is not None:
            raise Refused(f"{where or what} is not Unicode text: it holds a lone surrogate (an escape such as "
                          "\\ud800 without its pair)", param=where or None)
    return value


def _not_json(constant: str) -> None:
    raise ValueError(f"{constant} is not a JSON value")


def _finite(number: str) -> float:
    value = float(number)
    if not math.isfinite(value):  # 1e999: Python reads it as inf
        raise ValueError(f"{number} is past a float's range")
    return value


def _lone_surrogate(value: Any) -> str | None:
    """Where in a decoded JSON value a string (or key) is not Unicode text ("" the value itself); None: nowhere."""
    stack: list[tuple[str, Any]] = [("", value)]
    while stack:
        where, node = stack.pop()
        if isinstance(node, str):
            if not _is_text(node):
                return where
        elif isinstance(node, dict):
            for key, item in node.items():
                path = f"{where}.{key}" if where else key
                if not _is_text(key):
                    return f"{where}.{ascii(key)}" if where else ascii(key)
                stack.append((path, item))
        elif isinstance(node, list):
            stack.extend((f"{where}[{i}]", item) for i, item in enumerate(node))
    return None


def _is_text(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def validated(body: Body, schema: type[M], config: ServeConfig) -> M:
    """The body's JSON checked against a request schema and this server's model; `Refused` says why not."""
    raw = json_object(body) if isinstance(body, bytes) else body
    if not isinstance(raw, dict):
        raise Refused("the body must be a JSON object")
    try:
        request = schema.model_validate(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or None
        raise Refused(f"{where}: {first['msg']}" if where else first["msg"], param=where) from None
    model = getattr(request, "model")
    if model not in (None, config.served_model_name):
        raise Refused(f"model {model!r} is not served here; this server serves {config.served_model_name!r}",
                      status=404, param="model")
    return request


def check_prompt_length(prompt_ids: list[int], max_prompt_tokens: int | None, param: str) -> None:
    """A prompt longer than the first stage's engine takes is the request's (its engine would fail it)."""
    if max_prompt_tokens is not None and len(prompt_ids) > max_prompt_tokens:
        raise Refused(f"{param} makes a prompt of {len(prompt_ids)} tokens; this server's model takes at most "
                      f"{max_prompt_tokens}", param=param)


def voice_index(voice: str | None, config: ServeConfig, param: str = "voice") -> int:
    """The voice's index in the config's voices, matched in any case and stripped (as vllm-omni matches
    it); none (or blank): the first."""
    voice = (voice or "").strip()
    if not voice:
        return 0
    named = [v.lower() for v in config.voices]
    if voice.lower() not in named:
        raise Refused(f"unknown voice {voice!r}; voices: {', '.join(config.voices)}", param=param)
    return named.index(voice.lower())
