"""The speech request, with vllm-omni's field names (its `OpenAICreateSpeechRequest`, read, not
imported: that module cannot be imported without vllm-omni's package and its patches), so a
client written for vllm-omni's server sends the same JSON here. Fields this server cannot honour
are refused with a 400 naming them, never silently dropped.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, field_validator

_INT64_MAX = 2**63 - 1


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

    @field_validator("voice", mode="before")
    @classmethod
    def _voice_id(cls, voice: Any) -> Any:
        if isinstance(voice, dict):
            if "id" not in voice:
                raise ValueError("voice dict must contain 'id'")
            return voice["id"]
        return voice


def unsupported_fields(request: SpeechRequest) -> list[str]:
    """Fields set to something this server cannot honour (unknown ones included)."""
    named = [name for name, default in UNSUPPORTED.items() if getattr(request, name) not in (default,)]
    extra = [name for name, value in (request.model_extra or {}).items() if value not in (None, False)]
    return named + sorted(extra)


# Accepted for a vllm-omni client's sake, but this server's models take none of them: set to
# anything but their default, a 400 names the field.
UNSUPPORTED = {
    "instructions": None, "sample_rate": None, "task_type": None, "ref_audio": None, "ref_text": None,
    "x_vector_only_mode": None, "speaker_embedding": None, "extra_params": None, "non_streaming_mode": None,
    "speed": 1.0, "initial_codec_chunk_frames": None,  # the first chunk is the code2wav sidecar's option here
}
LANGUAGES = (None, "Auto", "auto")


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
