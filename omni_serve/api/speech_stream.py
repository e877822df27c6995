"""`WS /v1/audio/speech/stream`: text in as it is written, speech out per flush, over one WebSocket,
in vllm-omni's protocol (its `serving_speech_stream.py`, read, not imported), so its streaming
clients work here.

Client -> server, JSON text frames:
    {"type": "session.config", ...}   the speech request's fields but `input` (first; again between
                                      utterances to change them); `stream_audio` true: PCM as it is
                                      made (response_format "pcm"), else the whole answer in its format
    {"type": "input.text", "text": "..."}  buffered
    {"type": "input.done"}            the buffered text synthesized as one request; the connection stays
    {"type": "session.close"}
Server -> client:
    {"type": "audio.start", "utterance_index", "sentence_index": 0, "sentence_text", "format"
     (, "sample_rate" when streaming PCM)}, binary frames of audio, {"type": "audio.done", ...,
     "total_bytes", "error"}, then {"type": "session.done", "utterance_index", "total_sentences"};
    {"type": "error", "message"} for a message refused (before the first good session.config the
    connection then closes) or a request that failed.
A session waits CONFIG_TIMEOUT_S for its config and IDLE_TIMEOUT_S for any later message; its buffered
text may reach the config's max_input_chars. Unknown config fields are refused by name (vllm-omni
ignores them), as /v1/audio/speech refuses them.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any, AsyncIterator, Awaitable, Callable

import numpy as np
from fastapi import WebSocket, WebSocketDisconnect
from pydantic import TypeAdapter, ValidationError
from vllm.logger import init_logger

from omni_serve.api import audio
from omni_serve.api.protocol import Refused, json_object
from omni_serve.speech.pipeline import SpeechJob, StageFailed

if TYPE_CHECKING:
    from omni_serve.api.server import SpeechInput

logger = init_logger(f"vllm.{__name__}")  # under vLLM's logger: its handler, format and VLLM_LOGGING_LEVEL

CONFIG_TIMEOUT_S = 10.0  # vllm-omni's: the first message must come within this
IDLE_TIMEOUT_S = 30.0
MAX_CONFIG_CHARS = 48 << 20  # a voice-cloning config carries its reference audio inline (reference.py's cap, in base64)
MAX_TEXT_CHARS = 128 << 10
# The session config's own fields; the rest are the speech request's.
STREAM_AUDIO, WORD_TIMESTAMPS = "stream_audio", "word_timestamps"
_FLAG = TypeAdapter(bool)  # "true", 1, ...: as leniently as vllm-omni's pydantic config reads them

Check = Callable[[dict[str, Any]], Awaitable["SpeechInput"]]  # a speech request body -> SpeechInput, else Refused
Synthesize = Callable[[SpeechJob, float], AsyncIterator[np.ndarray]]


def _flag(fields: dict[str, Any], name: str) -> bool:
    try:
        return _FLAG.validate_python(fields.pop(name, False))
    except ValidationError:
        raise Refused(f"{name} must be true or false") from None


class SessionConfig:
    """A session's speech request fields, checked as /v1/audio/speech checks them."""

    def __init__(self, message: dict[str, Any]) -> None:
        fields = {k: v for k, v in message.items() if k != "type"}
        self.stream_audio = _flag(fields, STREAM_AUDIO)
        if _flag(fields, WORD_TIMESTAMPS):
            raise Refused("word_timestamps=true needs a forced aligner, which this server does not run; "
                          "set word_timestamps=false")
        if "input" in fields:
            raise Refused("session.config takes no input: send the text as input.text messages")
        for name in ("stream", "stream_format"):
            if name in fields:
                raise Refused(f"session.config takes no {name}: {STREAM_AUDIO} says whether audio streams")
        self.fields = fields
        self.response_format = ""

    @classmethod
    async def checked(cls, message: dict[str, Any], check: Check) -> "SessionConfig":
        """The config, every field checked now, as a flush sends them."""
        config = cls(message)
        config.response_format = (await check(config.body("ping"))).response_format
        if config.stream_audio and config.response_format != "pcm":
            raise Refused(f"{STREAM_AUDIO}=true sends PCM as it is made: set response_format='pcm' "
                          f"(got {config.response_format!r})")
        return config

    def body(self, text: str) -> dict[str, Any]:
        return {**self.fields, "input": text, "stream": self.stream_audio}


async def serve_session(websocket: WebSocket, check: Check, synthesize: Synthesize, sample_rate: int,
                        max_input_chars: int) -> None:
    """One connection: any number of utterances, until session.close, a timeout or the client goes."""
    await websocket.accept()
    config: SessionConfig | None = None
    text_parts: list[str] = []
    buffered_chars = 0
    utterance_index = 0
    try:
        while True:
            try:
                raw = await asyncio.wait_for(_receive_text(websocket),
                                             CONFIG_TIMEOUT_S if config is None else IDLE_TIMEOUT_S)
            except asyncio.TimeoutError:
                await _error(websocket, "timeout waiting for session.config" if config is None
                             else f"idle for {IDLE_TIMEOUT_S:.0f} s: session closed")
                await websocket.close()
                return
            try:
                message = _parse(raw)
                kind = message.get("type")
                if kind == "session.config":
                    if text_parts:
                        raise Refused("session.config cannot change a session while text is buffered; "
                                      "send input.done first")
                    config = await SessionConfig.checked(message, check)
                elif config is None:
                    raise Refused(f"the first message must be session.config, got {kind!r}")
                elif kind == "input.text":
                    text = message.get("text", "")
                    if not isinstance(text, str):
                        raise Refused("input.text needs a string text")
                    if buffered_chars + len(text) > max_input_chars:  # refused now, not at the flush
                        raise Refused(f"the buffered text would pass {max_input_chars} characters; "
                                      "send input.done first")
                    text_parts.append(text)
                    buffered_chars += len(text)
                elif kind == "input.done":
                    text = "".join(text_parts).strip()
                    text_parts.clear()
                    buffered_chars = 0
                    if text:
                        await _utterance(websocket, config, text, utterance_index, check, synthesize, sample_rate)
                    await websocket.send_json({"type": "session.done", "utterance_index": utterance_index,
                                               "total_sentences": 1 if text else 0})
                    utterance_index += 1
                elif kind == "session.close":
                    await websocket.close()
                    return
                else:
                    raise Refused(f"unknown message type {kind!r}")
            except Refused as exc:
                await _error(websocket, str(exc))
                if config is None:  # nothing to serve on: as vllm-omni, the connection ends
                    await websocket.close()
                    return
    except WebSocketDisconnect:
        logger.info("speech stream: the client disconnected after %d utterance(s)", utterance_index)
    except Exception as exc:  # never a silent end: the client hears why, the log has the trace
        logger.exception("speech stream session failed")
        try:
            await _error(websocket, f"internal error: {exc}")
            await websocket.close(code=1011)
        except Exception:  # the socket is gone too
            pass


async def _receive_text(websocket: WebSocket) -> str | None:
    """The next frame's text; None for a binary frame (refused by `_parse`: the messages are JSON text)."""
    message = await websocket.receive()
    if message["type"] == "websocket.disconnect":
        raise WebSocketDisconnect(message.get("code", 1000), message.get("reason"))
    return message.get("text")


def _parse(raw: str | None) -> dict[str, Any]:
    if raw is None:
        raise Refused("a binary frame: the messages are JSON text frames")
    if len(raw) > MAX_CONFIG_CHARS:
        raise Refused(f"a message of {len(raw)} characters; at most {MAX_CONFIG_CHARS}")
    message = json_object(raw, "the message")
    if message.get("type") != "session.config" and len(raw) > MAX_TEXT_CHARS:
        raise Refused(f"a {message.get('type')} message of {len(raw)} characters; at most {MAX_TEXT_CHARS}")
    return message


async def _error(websocket: WebSocket, message: str) -> None:
    await websocket.send_json({"type": "error", "message": message})


async def _utterance(websocket: WebSocket, config: SessionConfig, text: str, index: int, check: Check,
                     synthesize: Synthesize, sample_rate: int) -> None:
    """One flush's text as one speech request: audio.start, its audio, audio.done (error true when the
    text was refused or the request failed), as vllm-omni sends them."""
    arrived = time.monotonic()
    start = {"type": "audio.start", "utterance_index": index, "sentence_index": 0, "sentence_text": text,
             "format": config.response_format}
    if config.stream_audio:
        start["sample_rate"] = sample_rate
    await websocket.send_json(start)
    sent, failed = 0, False
    try:
        got = await check(config.body(text))
    except Refused as exc:  # the text's own fault (a prompt too long, ...): the session serves on
        failed = True
        await _error(websocket, str(exc))
    else:
        chunks = synthesize(got.job, arrived)
        try:
            if config.stream_audio:
                async for chunk in chunks:
                    data = audio.pcm16(chunk)
                    sent += len(data)
                    await websocket.send_bytes(data)
            else:
                # A client gone meanwhile is seen at the send (as in vllm-omni): the request runs whole.
                parts = [chunk async for chunk in chunks]
                samples = np.concatenate(parts) if parts else np.zeros(0, np.float32)
                data = await asyncio.to_thread(audio.encoded, samples, config.response_format, sample_rate)
                await websocket.send_bytes(data)
                sent = len(data)
        except WebSocketDisconnect:
            raise
        except Exception as exc:  # StageFailed, or anything else: the utterance failed, the session serves on
            failed = True
            if isinstance(exc, StageFailed):
                logger.error("speech stream utterance %d failed: %s", index, exc)
            else:
                logger.exception("speech stream utterance %d failed", index)
            await _error(websocket, f"the speech pipeline failed utterance {index}: {exc}")
        finally:
            await chunks.aclose()  # a client gone mid-utterance: its request aborted in every stage
    await websocket.send_json({"type": "audio.done", "utterance_index": index, "sentence_index": 0,
                               "total_bytes": sent, "error": failed})
