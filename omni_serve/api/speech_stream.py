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
A session waits CONFIG_TIMEOUT_S for its config and IDLE_TIMEOUT_S for any later message.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from typing import Any, AsyncIterator, Callable

import numpy as np
from fastapi import WebSocket, WebSocketDisconnect
from vllm.logger import init_logger

from omni_serve.api import audio
from omni_serve.api.protocol import Refused
from omni_serve.speech.pipeline import SpeechJob, StageFailed

logger = init_logger("omni_serve.speech_stream")

CONFIG_TIMEOUT_S = 10.0  # vllm-omni's: the first message must come within this
IDLE_TIMEOUT_S = 30.0
MAX_CONFIG_BYTES = 4 << 20  # a config may carry reference audio (refused here, but read to say so)
MAX_TEXT_BYTES = 128 << 10
# The session config's own fields; the rest are the speech request's.
STREAM_AUDIO, WORD_TIMESTAMPS = "stream_audio", "word_timestamps"

Check = Callable[[dict[str, Any]], Any]  # a speech request body -> SpeechInput (or Refused)
Synthesize = Callable[[SpeechJob, float], AsyncIterator[np.ndarray]]


class SessionConfig:
    """A session's speech request fields, checked as /v1/audio/speech checks them."""

    def __init__(self, message: dict[str, Any], check: Check) -> None:
        fields = {k: v for k, v in message.items() if k != "type"}
        self.stream_audio = fields.pop(STREAM_AUDIO, False)
        if not isinstance(self.stream_audio, bool):
            raise Refused(f"{STREAM_AUDIO} must be true or false")
        if fields.pop(WORD_TIMESTAMPS, False):
            raise Refused("word_timestamps=true needs a forced aligner, which this server does not run; "
                          "set word_timestamps=false")
        if "input" in fields:
            raise Refused("session.config takes no input: send the text as input.text messages")
        self.fields = fields
        self.response_format = fields.get("response_format") or "wav"
        if self.stream_audio and self.response_format != "pcm":
            raise Refused(f"{STREAM_AUDIO}=true sends PCM as it is made: set response_format='pcm' "
                          f"(got {self.response_format!r})")
        check(self.body("ping"))  # every field checked now, not at the first flush

    def body(self, text: str) -> dict[str, Any]:
        return {**self.fields, "input": text, "stream": self.stream_audio}


async def serve_session(websocket: WebSocket, check: Check, synthesize: Synthesize, sample_rate: int) -> None:
    """One connection: any number of utterances, until session.close, a timeout or the client goes."""
    await websocket.accept()
    config: SessionConfig | None = None
    text_parts: list[str] = []
    utterance = 0
    try:
        while True:
            try:
                raw = await asyncio.wait_for(websocket.receive_text(),
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
                    config = SessionConfig(message, check)
                elif config is None:
                    raise Refused(f"the first message must be session.config, got {kind!r}")
                elif kind == "input.text":
                    if not isinstance(message.get("text"), str):
                        raise Refused("input.text needs a string text")
                    text_parts.append(message["text"])
                elif kind == "input.done":
                    text = "".join(text_parts).strip()
                    text_parts.clear()
                    if text:
                        await _utterance(websocket, config, text, utterance, check, synthesize, sample_rate)
                    await websocket.send_json({"type": "session.done", "utterance_index": utterance,
                                               "total_sentences": 1 if text else 0})
                    utterance += 1
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
        logger.info("speech stream: the client disconnected after %d utterance(s)", utterance)


def _parse(raw: str) -> dict[str, Any]:
    if len(raw) > MAX_CONFIG_BYTES:
        raise Refused(f"a message of {len(raw)} bytes; at most {MAX_CONFIG_BYTES}")
    try:
        message = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise Refused(f"the message is not valid JSON: {exc}") from None
    if not isinstance(message, dict):
        raise Refused("a message must be a JSON object")
    if message.get("type") != "session.config" and len(raw) > MAX_TEXT_BYTES:
        raise Refused(f"a {message.get('type')} message of {len(raw)} bytes; at most {MAX_TEXT_BYTES}")
    return message


async def _error(websocket: WebSocket, message: str) -> None:
    await websocket.send_json({"type": "error", "message": message})


async def _utterance(websocket: WebSocket, config: SessionConfig, text: str, index: int, check: Check,
                     synthesize: Synthesize, sample_rate: int) -> None:
    """One flush's text as one speech request: audio.start, its audio, audio.done (error or not)."""
    arrived = time.monotonic()
    try:
        got = check(config.body(text))
    except Refused as exc:  # the text's own fault (too long, ...): the session serves on
        await _error(websocket, str(exc))
        return
    start = {"type": "audio.start", "utterance_index": index, "sentence_index": 0, "sentence_text": text,
             "format": config.response_format}
    if config.stream_audio:
        start["sample_rate"] = sample_rate
    await websocket.send_json(start)
    sent, failed = 0, False
    chunks = synthesize(got.job, arrived)
    try:
        if config.stream_audio:
            async for chunk in chunks:
                data = audio.pcm16(chunk)
                sent += len(data)
                await websocket.send_bytes(data)
        else:
            parts = [chunk async for chunk in chunks]
            samples = np.concatenate(parts) if parts else np.zeros(0, np.float32)
            data = await asyncio.to_thread(audio.encoded, samples, config.response_format, sample_rate)
            sent = len(data)
            await websocket.send_bytes(data)
    except StageFailed as exc:
        failed = True
        logger.error("speech stream utterance %d failed: %s", index, exc)
        await _error(websocket, f"the speech pipeline failed utterance {index}: {exc}")
    finally:
        await chunks.aclose()  # a client gone mid-utterance: its request aborted in every stage
    with contextlib.suppress(WebSocketDisconnect, RuntimeError):
        await websocket.send_json({"type": "audio.done", "utterance_index": index, "sentence_index": 0,
                                   "total_bytes": sent, "error": failed})
