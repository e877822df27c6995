"""The HTTP front end and the stages it runs: `POST /v1/audio/speech`, `WS /v1/audio/speech/stream`,
`POST /v1/audio/speech/batch`, `POST /v1/chat/completions` (a pipeline with a thinker: its text and its
speech), `GET /v1/models`, `/v1/audio/voices` (and, for a model that clones voices, uploads to it: POST,
DELETE), `/health`, `/metrics`.

Started by `omni-serve` (omni_serve/cli.py). On start-up each stage's sidecar is started (or
attached to) and its engine built; on shutdown the engines stop, then the sidecars.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import functools
import gc
import importlib
import json
import socket
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, AsyncIterator, Awaitable, Callable, TypedDict, TypeVar

import numpy as np
import uvicorn
from fastapi import FastAPI, Request, WebSocket
from fastapi.responses import JSONResponse, Response, StreamingResponse
from vllm.logger import init_logger

from omni_serve.api import audio
from omni_serve.api.chat import ChatInput, Part, TextDeltas, Tokenizer, chat_input, chat_sse, completion
from omni_serve.api.metrics import SpeechMetrics
from omni_serve.api.protocol import (CLONING_FIELDS_HONOURED, Body, Refused, SpeechRequest, ThinkerPrompt, batch_items,
                                     check_prompt_length, error_body, unsupported_fields, validated, voice_index)
from omni_serve.api.speech_stream import serve_session
from omni_serve.config import ServeConfig, load_callable
from omni_serve.speech.codes_log import CodesLog
from omni_serve.speech.prompts import AUTO_LANGUAGE, SpeechPrompt, TextVoicePrompt, load_speech_prompt
from omni_serve.speech.pipeline import SpeechJob, SpeechPipeline, Stage, StageFailed, ThinkerStage, stop_soon
from omni_serve.speech.reference import URI_FORMS, BadReference, References, VoiceReference
from omni_serve.speech.voices import (EMBEDDING_VOICE, MAX_EMBEDDING_SIZE, MAX_UPLOAD_BYTES, BadUpload, UploadedVoice,
                                      UploadedVoices)
from omni_serve.speech.voices import default_dir as default_voice_dir
from omni_serve.speech.voices import default_limit as default_voice_limit
from omni_serve.stages.link import AsyncSidecarClient
from omni_serve.stages.sidecars import SidecarProcess
from proto.capabilities import HookNeeds
from proto.chunk_grid import ChunkGrid
from proto.settings import CODE2WAV_CHUNK_FRAMES, CODE2WAV_LEFT_CONTEXT_FRAMES

logger = init_logger(f"vllm.{__name__}")  # under vLLM's logger: its handler, format and VLLM_LOGGING_LEVEL
ENGINE_WATCH_S = 0.5  # how often the stage engines are checked for one that died
DRAIN_POLL_S = 0.05  # how often a shutdown looks at the requests still in flight
SHUTTING_DOWN = "the server is shutting down"
SHUTDOWN_ANSWER_S = 5  # past the drain: how long the HTTP server waits for the last answers (503s) to go out
RECONNECT_TIMEOUT_S = 10.0  # a shim's reconnect waits a fraction of a second; an engine deep in a step, longer
T = TypeVar("T")
# A request's reference audio by its source (a ref_audio URI, or an uploaded voice) -> (mono float32, rate).
ReferenceAudio = Callable[[str | UploadedVoice], tuple[np.ndarray, int]]


@dataclass
class SpeechInput:
    """A validated request: what the pipeline runs and how the answer is shaped."""

    job: SpeechJob
    response_format: str
    stream: bool
    sse: bool


def speech_input(body: Body, config: ServeConfig, prompt: SpeechPrompt, max_prompt_tokens: int | None = None,
                 references: ReferenceAudio | None = None, voices: UploadedVoices | None = None) -> SpeechInput:
    """A speech request checked against the schema and this server's model (`max_prompt_tokens`: the
    first stage's engine's; None: unchecked; `references`: a reference audio's samples and rate by its
    source, `voices` those uploaded, for a model that clones voices); `Refused` says why not."""
    request = validated(body, SpeechRequest, config)
    if not request.input.strip():
        raise Refused("input is empty", param="input")
    text = request.input  # as sent: vllm-omni's talker reads it so
    if len(request.input) > config.max_input_chars:
        raise Refused(f"input has {len(request.input)} characters; at most {config.max_input_chars}", param="input")
    voice = voice_index(request.voice, config) if config.voices else 0  # no voices: a name is an uploaded one
    if request.response_format not in audio.FORMATS:
        raise Refused(f"response_format {request.response_format!r} is not supported; supported: "
                      f"{', '.join(audio.FORMATS)}", param="response_format")
    if request.task_type not in (None, prompt.task_type):  # vllm-omni's own examples send CustomVoice
        raise Refused(f"task_type {request.task_type!r} is not served by this model; it serves {prompt.task_type!r}",
                      param="task_type")
    language = spoken_language(request.language, prompt)
    instructions = request.instructions or ""
    if prompt.instructions_required and not instructions.strip():
        raise Refused("this model's voice is described in instructions (VoiceDesign): instructions are required",
                      param="instructions")
    if len(instructions) > prompt.max_instructions_chars:
        raise Refused(f"instructions has {len(instructions)} characters; this model takes at most "
                      f"{prompt.max_instructions_chars}" if prompt.max_instructions_chars else
                      "instructions are not supported by this model", param="instructions")
    if request.sample_rate not in (None, config.sample_rate):
        raise Refused(f"sample_rate {request.sample_rate} is not supported; this model makes "
                      f"{config.sample_rate} Hz", param="sample_rate")
    refused = unsupported_fields(request, CLONING_FIELDS_HONOURED if prompt.clones_voices else None)
    if refused:
        raise Refused(f"not supported by this model: {', '.join(refused)}", param=refused[0])
    # vllm-omni's rule (and the OpenAI SDK's, which sends stream_format alone): a stream_format streams.
    stream = request.stream or request.stream_format is not None
    if stream and request.response_format not in audio.STREAMED_FORMATS:
        raise Refused(f"a stream is {' or '.join(audio.STREAMED_FORMATS)}; response_format "
                      f"{request.response_format!r} is for a whole answer (stream=false)", param="response_format")
    encoding_problem = audio.encoding_problem(request.response_format, config.sample_rate)
    if encoding_problem:
        raise Refused(encoding_problem, param="response_format")
    talker = config.stages["talker"]
    ceiling = prompt.max_frames(text) if request.max_new_tokens is None else None
    frames = request.max_new_tokens or min(talker.max_tokens, ceiling or talker.max_tokens)
    if frames > talker.max_tokens:
        raise Refused(f"max_new_tokens {frames} is above this server's limit of {talker.max_tokens}",
                      param="max_new_tokens")
    least = talker.sampling.get("min_tokens") or 0  # vLLM refuses a request's max_tokens below it
    if frames < least:
        raise Refused(f"max_new_tokens {frames} is below the {least} frames this server's talker makes at least "
                      "(its min_tokens)", param="max_new_tokens")
    # After the cheaper checks: a reference may be fetched (speech_input_fetched fetches it once they pass).
    reference = (voice_reference(request, references, voices, prompt.speaker_embedding_size)
                 if prompt.clones_voices else None)
    prompt_ids, payload = prompt(text, voice, language, instructions, reference)
    check_prompt_length(prompt_ids, max_prompt_tokens, "input")
    counted = prompt.text_tokens(text, instructions)
    job = SpeechJob(f"speech-{uuid.uuid4().hex}", prompt_ids, payload, frames, request.seed,
                    input_tokens=counted if counted is not None else text_tokens(config, prompt_ids, payload),
                    reference_tokens=prompt.reference_tokens(reference) if reference is not None else 0,
                    sampling={"talker": {"ignore_eos": True}} if request.ignore_eos else {})
    return SpeechInput(job, request.response_format, stream, request.stream_format != "audio")


def voice_reference(request: SpeechRequest, references: ReferenceAudio | None, voices: UploadedVoices | None,
                    embedding_size: int) -> VoiceReference:
    """A voice-cloning request's voice, by vllm-omni's Base rules: its speaker embedding itself
    (`speaker_embedding`, the embedding alone), audio inline (`ref_audio`), or an uploaded voice `voice`
    names (its clip, its transcript unless the request gives one; or its embedding); a clip's transcript
    unless `x_vector_only_mode` (an uploaded clip without one: the embedding alone)."""
    if request.speaker_embedding is not None:
        if request.ref_audio is not None:
            raise Refused("speaker_embedding and ref_audio are two ways of giving the voice: give one",
                          param="speaker_embedding")
        return VoiceReference(None, 0, "", True, speaker_embedding(request.speaker_embedding, embedding_size))
    uploaded = voices.get(request.voice) if voices is not None and request.voice and request.ref_audio is None else None
    if request.ref_audio is None and uploaded is None:
        if request.voice and request.voice.strip():
            names = ", ".join(v.name for v in voices.all()) if voices is not None else ""
            raise Refused(f"unknown voice {request.voice!r}: this model clones the voice of ref_audio or of a voice "
                          f"uploaded with POST /v1/audio/voices (uploaded: {names or 'none'})", param="voice")
        raise Refused("this model clones the voice of reference audio (a Base checkpoint): ref_audio is required, "
                      "or the name of a voice uploaded with POST /v1/audio/voices, or a speaker_embedding",
                      param="ref_audio")
    if uploaded is not None and voices is not None and uploaded.embedding_source == EMBEDDING_VOICE:
        try:
            embedding = voices.embedding(uploaded)
        except BadReference as exc:
            raise Refused(str(exc), param="voice") from None
        return VoiceReference(None, 0, "", True, speaker_embedding(embedding, embedding_size, "voice"),
                              voice=(uploaded.key, uploaded.created_at))
    if request.ref_audio is not None and not isinstance(request.ref_audio, str):
        raise Refused(f"ref_audio is one {URI_FORMS}", param="ref_audio")
    text = request.ref_text if request.ref_text is not None else (uploaded.ref_text or "") if uploaded else ""
    x_vector_only = (bool(request.x_vector_only_mode) if request.x_vector_only_mode is not None
                     else uploaded is not None and not text.strip())
    if not x_vector_only and not text.strip():
        raise Refused("ref_text (the reference audio's transcript) is required unless x_vector_only_mode is true",
                      param="ref_text")
    source: str | UploadedVoice | None = uploaded if uploaded is not None else request.ref_audio
    if references is None or source is None:
        raise Refused("this server takes no reference audio", param="ref_audio")
    try:
        audio, rate = references(source)
    except BadReference as exc:
        raise Refused(str(exc), param="voice" if uploaded is not None else "ref_audio") from None
    return VoiceReference(audio, rate, "" if x_vector_only else text, x_vector_only,
                          voice=(uploaded.key, uploaded.created_at) if uploaded is not None else None)


def speaker_embedding(values: list[float] | list[list[float]] | np.ndarray, size: int,
                      param: str = "speaker_embedding") -> np.ndarray:
    """A precomputed speaker embedding as the talker takes it: one vector of its width, finite."""
    if not size:
        raise Refused("this model takes no precomputed speaker embedding", param=param)
    if any(isinstance(value, list) for value in values):
        raise Refused("speaker_embedding is one embedding: a flat list of numbers", param=param)
    if len(values) != size:
        raise Refused(f"speaker_embedding has {len(values)} dimensions; this model's is {size}", param=param)
    try:
        embedding = np.asarray(values, dtype=np.float32)
    except (OverflowError, ValueError, TypeError):
        raise Refused("speaker_embedding's values must be numbers a float holds", param=param) from None
    if not np.isfinite(embedding).all():
        raise Refused("speaker_embedding's values must be finite (no NaN or Inf)", param=param)
    return embedding


class _Unfetched(Exception):
    """speech_input reached a reference it has not fetched: every cheaper check passed."""

    def __init__(self, source: str | UploadedVoice) -> None:
        super().__init__(source)
        self.source = source


async def speech_input_fetched(body: Body, config: ServeConfig, prompt: SpeechPrompt, max_prompt_tokens: int | None,
                               references: ReferenceAudio, voices: UploadedVoices | None) -> SpeechInput:
    """speech_input with the request's reference audio fetched and decoded off the event loop, once the
    request's cheaper checks have passed (the request is checked on the loop: its tokenizers are used
    from one thread)."""

    def unfetched(source: str | UploadedVoice) -> tuple[np.ndarray, int]:
        raise _Unfetched(source)

    try:
        return speech_input(body, config, prompt, max_prompt_tokens, unfetched, voices)
    except _Unfetched as pending:
        source = pending.source
    try:
        prefetched: tuple[np.ndarray, int] | BadReference = await asyncio.to_thread(references, source)
    except BadReference as exc:
        prefetched = exc

    def fetched(asked: str | UploadedVoice) -> tuple[np.ndarray, int]:
        if asked != source:  # an uploaded voice replaced meanwhile
            raise BadReference("the request's voice changed while the request was read")
        if isinstance(prefetched, BadReference):
            raise prefetched
        return prefetched

    return speech_input(body, config, prompt, max_prompt_tokens, fetched, voices)


def spoken_language(language: str | None, prompt: SpeechPrompt) -> str:
    """The request's language as vllm-omni names it (title case; none: Auto), if the model speaks it."""
    if language is None or language.strip().lower() == AUTO_LANGUAGE.lower():
        return AUTO_LANGUAGE
    named = language.strip().title()
    if named not in prompt.languages:
        raise Refused(f"language {language!r} is not supported by this model; supported: "
                      f"{', '.join([AUTO_LANGUAGE, *prompt.languages])}", param="language")
    return named


def one_message(thinker_prompt: ThinkerPrompt, text: str, voice: int) -> tuple[list[int], dict]:
    """/v1/audio/speech's input as the thinker's prompt: a conversation of one user message."""
    return thinker_prompt([{"role": "user", "content": text}], voice)


def text_tokens(config: ServeConfig, prompt_ids: list[int], payload: dict[str, Any]) -> int:
    """The text's tokens as the first stage reads them: a thinker's prompt; a Qwen3-TTS talker's
    text rows (`hidden_states.output`: its prompt holds only a few of them, it reads the rest
    while it decodes), so the count follows the text, not the prompt's length."""
    rows = payload.get("hidden_states", {}).get("output") if "thinker" not in config.stages else None
    return int(rows.shape[0]) if isinstance(rows, np.ndarray) and rows.ndim == 2 else len(prompt_ids)


def usage(job: SpeechJob) -> dict[str, Any]:
    """vllm-omni's `SpeechTokenUsage` (OpenAI's speech.audio.done `usage`): input tokens are the text's and,
    for an in-context voice clone, its reference's codec frames; output tokens the codec frames the talker
    made."""
    read = job.input_tokens + job.reference_tokens
    return {"input_tokens": read, "output_tokens": job.frames, "total_tokens": read + job.frames,
            "input_token_details": {"text_tokens": job.input_tokens, "audio_tokens": job.reference_tokens}}


class SpeechServer:
    """The stages (sidecars, engines, links), the pipeline over them and the metrics."""

    def __init__(self, config: ServeConfig, run_dir: Path, codes_log: Path | None = None,
                 references: References | None = None, voice_dir: Path | None = None) -> None:
        """`references`: where a request's reference audio may come from (default: inline and any
        http(s) host); `voice_dir`: where uploaded voices are kept (default: vllm-omni's)."""
        self.config = config
        self.run_dir = run_dir
        self.codes_log = CodesLog(codes_log) if codes_log is not None else None
        self.references = references or References()
        # The first stage's prompt: with a thinker, one function for both endpoints (its conversation).
        self.thinker_prompt: ThinkerPrompt | None = None
        if config.thinker_prompt:
            self.thinker_prompt = load_callable(config.thinker_prompt)
            self.prompt: SpeechPrompt = TextVoicePrompt(functools.partial(one_message, self.thinker_prompt),
                                                        list(config.voices))
        else:
            self.prompt = load_speech_prompt(config)
            self.config = config = dataclasses.replace(config, voices=list(self.prompt.voices))
        # Voices uploaded for cloning: only a model that clones voices speaks in them.
        self.voices: UploadedVoices | None = None
        if self.prompt.clones_voices:
            self.voices = UploadedVoices(voice_dir or default_voice_dir(), default_voice_limit())
            restored, skipped = self.voices.restore()
            if restored or skipped:
                logger.info("Uploaded voices: %d in %s%s", restored, self.voices.directory,
                            f"; {len(skipped)} file(s) skipped: {'; '.join(skipped[:3])}" if skipped else "")
        self.tokenizer: Tokenizer | None = None  # the thinker checkpoint's: its text for the chat endpoint
        # The longest prompt the first stage's engine takes (its max_model_len less the one token it must
        # make): longer is the request's fault, a 400, not a 503 from the engine. None until it starts.
        self.max_prompt_tokens: int | None = None
        self.vocab_sizes: dict[str, int] = {}  # each stage engine's (a request's stop_token_ids within it)
        self.sidecars = {name: SidecarProcess(name, spec.sidecar, run_dir) for name, spec in config.stages.items()}
        self.metrics = SpeechMetrics(list(config.stages))
        self.pipeline: SpeechPipeline | None = None
        self.engines: dict[str, Any] = {}
        self.needs: dict[str, HookNeeds] = {}  # each stage's hooks' needs (its engine's settings follow from them)
        self.engine_restarts = {name: 0 for name in config.stages}
        self._engine_watch: asyncio.Task | None = None
        self.draining = False  # shutting down: no new request is served (`drain`)
        self.requests_in_flight = 0  # speech and chat requests between their first chunk asked and their last

    def reference_audio(self, source: str | UploadedVoice) -> tuple[np.ndarray, int]:
        """A request's reference audio: by its URI, or an uploaded voice's clip (a `ReferenceAudio`)."""
        if isinstance(source, UploadedVoice):
            if self.voices is None:
                raise BadReference("this server keeps no uploaded voices")
            return self.voices.clip(source)
        return self.references.audio(source)

    def _observe_first_audio_share(self, stage: str, seconds: float) -> None:
        self.metrics.first_audio_share.labels(stage).observe(seconds)

    async def start(self) -> None:
        from omni_serve.stages.engines import start_engine

        for name, spec in self.config.stages.items():
            if spec.build and not Path(spec.model).exists():
                load_callable(spec.build)(spec.model)
            await self.sidecars[name].start()
        if "thinker" in self.config.stages:
            from transformers import AutoTokenizer

            # The tokenizer the thinker's engine detokenizes with: its engine settings name it.
            thinker = self.config.stages["thinker"]
            self.tokenizer = await asyncio.to_thread(
                AutoTokenizer.from_pretrained, thinker.engine.get("tokenizer") or thinker.model,
                trust_remote_code=bool(thinker.engine.get("trust_remote_code", False)),
                revision=thinker.engine.get("tokenizer_revision"))
        from vllm.plugins import load_general_plugins

        load_general_plugins()  # once, before the engines start together (the shim's plugin registers the models)
        specs = list(self.config.stages.values())

        async def start(spec) -> None:
            sidecar = self.sidecars[spec.name]
            self.needs[spec.name] = await sidecar.needs()
            self.engines[spec.name] = await asyncio.to_thread(start_engine, spec, sidecar.endpoint,
                                                              spec.sidecar.curve_keys, self.needs[spec.name])

        if any(spec.device is not None for spec in specs):  # each placed through the environment: one at a time
            for spec in specs:
                await start(spec)
        else:  # their processes start and load at once
            await asyncio.gather(*(start(spec) for spec in specs))
        first_stage = next(iter(self.config.stages))  # its prompt is the request's: one too long is a 400
        self.max_prompt_tokens = self.engines[first_stage].model_config.max_model_len - 1
        self.vocab_sizes = {name: engine.model_config.get_vocab_size() for name, engine in self.engines.items()}
        stages = {name: Stage(name, self.engines[name], AsyncSidecarClient(self.sidecars[name].endpoint),
                              dict(self.config.stages[name].sampling)) for name in self.config.stages}
        code2wav = self.config.stages["code2wav"]
        options = code2wav.sidecar.options  # the sidecar's chunking (its defaults where not given)
        thinker = None
        if "thinker" in stages:
            first = self.config.stages["thinker"]
            thinker = ThinkerStage(stages["thinker"], first.max_tokens, load_callable(self.config.talker_prompt),
                                   first.model)
        self.pipeline = SpeechPipeline(stages["talker"], stages["code2wav"],
                                       ChunkGrid(int(options.get("chunk_frames", CODE2WAV_CHUNK_FRAMES)),
                                                 int(options.get("initial_chunk_frames", 0))),
                                       int(options.get("left_context", CODE2WAV_LEFT_CONTEXT_FRAMES)),
                                       code2wav.placeholder_token, thinker,
                                       int(options.get("codebook_size", 0)),
                                       first_audio_share=self._observe_first_audio_share,
                                       finished_codes=self.codes_log.write if self.codes_log is not None else None)
        for name, sidecar in self.sidecars.items():
            sidecar.on_restart = functools.partial(self._reconnect, name)
            sidecar.on_lost = stages[name].fail_served
        self._engine_watch = asyncio.create_task(self._watch_engines())

    async def _reconnect(self, name: str) -> None:
        """The stage's sidecar was started again: its engine's shim connects to it now."""
        engine = self.engines.get(name)
        if engine is None or engine.errored:
            return  # an engine started again connects at its start
        try:
            connected = await engine.collective_rpc("omni_sidecar_reconnect", timeout=RECONNECT_TIMEOUT_S)
        except Exception as exc:  # its next step connects it then
            logger.warning("the %s engine did not take up its restarted sidecar now: %s", name, exc)
            return
        logger.info("the %s engine %s its restarted sidecar", name,
                    "connected to" if all(connected) else "will connect at its next step to")

    async def _watch_engines(self) -> None:
        """An engine that died (its core process gone) is started again on the same sidecar. Until
        then its stage fails every request with a 503 and /health reports it down."""
        while True:
            await asyncio.sleep(ENGINE_WATCH_S)
            for name, engine in list(self.engines.items()):
                if engine.errored:
                    await self._restart_engine(name, engine)

    async def _restart_engine(self, name: str, dead: Any) -> None:
        from omni_serve.stages.engines import start_engine

        logger.error("the %s engine died; starting it again", name)
        try:
            dead.shutdown()  # what is left of it: its client's sockets and any worker still there
        except Exception:
            logger.exception("stopping what is left of the %s engine", name)
        spec = self.config.stages[name]
        try:
            engine = await asyncio.to_thread(start_engine, spec, self.sidecars[name].endpoint, spec.sidecar.curve_keys,
                                             self.needs.get(name))
        except Exception:
            logger.exception("starting the %s engine again failed; trying again", name)
            await asyncio.sleep(ENGINE_WATCH_S)
            return
        self.engines[name] = engine
        assert self.pipeline is not None
        next(stage for stage in self.pipeline.stages if stage.name == name).engine = engine
        self.engine_restarts[name] += 1
        logger.info("the %s engine is up again", name)

    async def drain(self, timeout_s: float) -> None:
        """Shutting down: new requests get a 503; those in flight have `timeout_s` to finish, then fail
        (a 503, an SSE error event, a stream cut short) so each handler answers before the HTTP server
        stops waiting for it (`--shutdown-timeout`, as vLLM's)."""
        self.draining = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        if self.requests_in_flight:
            logger.info("Shutting down: %d request(s) in flight%s", self.requests_in_flight,
                        f", given {timeout_s:g} s to finish" if timeout_s else " fail (--shutdown-timeout 0)")
        failing = False
        while self.requests_in_flight and self.pipeline is not None:
            if loop.time() >= deadline:
                if not failing and timeout_s:
                    logger.info("Shutting down: %d request(s) still in flight fail", self.requests_in_flight)
                failing = True
                for stage in self.pipeline.stages:  # again each turn: a request between two stages enters the next
                    stage.fail_served(SHUTTING_DOWN)
            await asyncio.sleep(DRAIN_POLL_S)

    async def stop(self) -> None:
        if self._engine_watch is not None:
            self._engine_watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._engine_watch
        if self.pipeline is not None:
            await self.pipeline.close()
        for name, engine in self.engines.items():
            try:
                engine.shutdown()
            except Exception:  # the others must still stop
                logger.exception("stopping the %s engine", name)
        self.engines.clear()  # stopped: nothing left for their finalizers at interpreter exit
        if self.pipeline is not None:
            for stage in self.pipeline.stages:
                stage.link.close()
        # Its stages hold the engines: freed now, not by their finalizers at interpreter exit (which
        # run without the modules they call).
        self.pipeline = None
        for sidecar in self.sidecars.values():
            await sidecar.stop()
        if self.codes_log is not None:
            self.codes_log.close()

    def health(self) -> dict[str, Any]:
        stages = {}
        for name, sidecar in self.sidecars.items():
            engine = self.engines.get(name)
            stages[name] = {"sidecar": "up" if sidecar.alive else "down", "sidecar_restarts": sidecar.restarts,
                            "engine": "up" if engine is not None and not engine.errored else "down",
                            "engine_restarts": self.engine_restarts[name]}
        ok = all(s["sidecar"] == "up" and s["engine"] == "up" for s in stages.values())
        return {"status": "ok" if ok else "degraded", "stages": stages}

    def observe(self) -> bytes:
        if self.pipeline is not None:
            for stage in self.pipeline.stages:
                self.metrics.queue.labels(stage.name).set(stage.in_flight)
        for name, sidecar in self.sidecars.items():
            self.metrics.sidecar_restarts.labels(name).set(sidecar.restarts)
            self.metrics.engine_restarts.labels(name).set(self.engine_restarts[name])
        return self.metrics.text()

    async def audio(self, job: SpeechJob, arrived: float) -> AsyncIterator[np.ndarray]:
        """The pipeline's chunks, timed for the metrics."""
        assert self.pipeline is not None
        if self.draining:
            raise StageFailed("omni-serve", SHUTTING_DOWN)
        samples, outcome = 0, "aborted"
        self.requests_in_flight += 1
        try:
            async with contextlib.aclosing(self.pipeline.synthesize(job)) as chunks:
                async for chunk in chunks:
                    if samples == 0 and chunk.size:
                        self.metrics.ttfa.observe(time.monotonic() - arrived)
                    samples += int(chunk.size)
                    yield chunk
            outcome = "ok"
        except StageFailed:
            outcome = "failed"
            raise
        finally:
            self.requests_in_flight -= 1
            self.metrics.requests.labels(outcome).inc()
            seconds = samples / self.config.sample_rate
            self.metrics.audio_seconds.inc(seconds)
            if outcome == "ok" and seconds:
                self.metrics.rtf.observe((time.monotonic() - arrived) / seconds)

    async def answer(self, job: SpeechJob, arrived: float) -> AsyncIterator[Part]:
        """A chat answer's parts as they come: the thinker's token deltas, then (`job.speak`) the
        audio chunks. Closing it (a client gone) aborts the request in every stage."""
        parts: asyncio.Queue[Part | None] = asyncio.Queue()
        job.on_text = parts.put_nowait

        async def run() -> None:
            async with contextlib.aclosing(self.audio(job, arrived)) as chunks:
                async for chunk in chunks:
                    parts.put_nowait(chunk)

        task = asyncio.create_task(run())
        task.add_done_callback(lambda _: parts.put_nowait(None))
        try:
            while (part := await parts.get()) is not None:
                yield part
            task.result()  # its StageFailed
        finally:
            stop_soon(task)  # no await here (see SpeechPipeline.synthesize): cancelled, it closes the pipeline's


def _refusal(exc: Refused) -> JSONResponse:
    return JSONResponse(error_body(str(exc), exc.status, exc.param), status_code=exc.status)


def _failure(exc: StageFailed) -> JSONResponse:
    return JSONResponse(error_body(f"the speech pipeline failed this request: {exc}", 503), status_code=503)


class DrainingServer(uvicorn.Server):
    """uvicorn's server, whose shutdown first drains the speech requests (`SpeechServer.drain`): each ends
    with its answer, or a 503 once the drain's time is up, before uvicorn stops waiting for its handler
    (past that it cancels the handler: a bare 500 and a traceback a request)."""

    def __init__(self, config: uvicorn.Config, drain: Callable[[float], Awaitable[None]], drain_s: float) -> None:
        super().__init__(config)
        self._drain, self._drain_s = drain, drain_s

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        drain = asyncio.create_task(self._drain(self._drain_s))
        try:
            await super().shutdown(sockets)
        finally:
            drain.cancel()


def freeze_start_up_heap() -> None:
    """What start-up made (torch's and vLLM's modules, the engines' clients) moves out of the
    collector's reach, as vLLM's API server does after start-up: a full collection would
    walk all of it while the event loop, and every stream's audio, waits."""
    gc.collect()
    gc.freeze()


# Where vLLM's API-key middleware lives, newest first (it moved between minors).
AUTH_MIDDLEWARE_MODULES = ("vllm.entrypoints.serve.middleware.authenticate",
                           "vllm.entrypoints.serve.utils.server_utils")


def require_api_keys(app: FastAPI, api_keys: list[str]) -> None:
    """vLLM's own API-key check on `app`, as `vllm serve --api-key` sets it: every /v1 route (HTTP and
    WebSocket) needs `Authorization: Bearer <one of api_keys>`, else a 401; /health and /metrics stay open."""
    for module in AUTH_MIDDLEWARE_MODULES:
        try:
            middleware = importlib.import_module(module).AuthenticationMiddleware
        except (ImportError, AttributeError):
            continue
        app.add_middleware(middleware, tokens=api_keys)
        return
    raise RuntimeError(f"this vLLM has no AuthenticationMiddleware (looked in {', '.join(AUTH_MIDDLEWARE_MODULES)})")


def build_app(server: SpeechServer, api_keys: list[str] | None = None) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        try:
            await server.start()
        except BaseException:
            await server.stop()
            raise
        freeze_start_up_heap()
        yield
        await server.stop()

    app = FastAPI(title="omni-serve", lifespan=lifespan)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        """A fault of the server's own in OpenAI's error form (the server logs its traceback)."""
        return JSONResponse(error_body(f"internal server error: {type(exc).__name__}", 500), status_code=500)

    if api_keys:
        require_api_keys(app, api_keys)
    config = server.config

    @app.get("/health")
    async def health() -> JSONResponse:
        state = server.health()
        return JSONResponse(state, status_code=200 if state["status"] == "ok" else 503)

    created = int(time.time())

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        """OpenAI's model list as vLLM's server gives it (`created`, `root`: the first stage's model), and
        the voices."""
        first_stage = next(iter(config.stages.values()))
        return {"object": "list", "data": [{
            "id": config.served_model_name, "object": "model", "created": created, "owned_by": "omni-serve",
            "root": first_stage.model, "parent": None, "max_model_len": first_stage.engine.get("max_model_len"),
            "voices": config.voices}]}

    @app.get("/v1/audio/voices")
    async def voices() -> dict[str, Any]:
        """vllm-omni's voice list: the names a request may give (any case; vllm-omni lists them lowercased
        and sorted), the uploaded ones among them, and those uploaded with their details."""
        uploaded = server.voices.all() if server.voices is not None else []
        return {"voices": sorted({v.lower() for v in config.voices} | {v.key for v in uploaded}),
                "uploaded_voices": [v.listing() for v in uploaded]}

    @app.post("/v1/audio/voices")
    async def upload_voice(request: Request) -> JSONResponse:
        """vllm-omni's voice upload (multipart form: audio_sample, name, consent, ref_text,
        speaker_description): the clip kept under the name, for Base requests that name it."""
        try:
            return JSONResponse({"success": True, "voice": await uploaded_voice(request, server.voices,
                                                                         server.prompt.speaker_embedding_size)})
        except Refused as exc:
            return _refusal(exc)

    @app.delete("/v1/audio/voices/{name}")
    async def delete_voice(name: str) -> JSONResponse:
        try:
            removed = server.voices is not None and await asyncio.to_thread(server.voices.remove, name)
        except OSError as exc:
            logger.error("Could not delete voice %r's file: %s", name, exc)
            return _refusal(Refused(f"the server could not delete voice {name!r}: {exc.strerror or exc}",
                                    status=500, param="name"))
        if not removed:
            return _refusal(Refused(f"voice {name!r} not found (GET /v1/audio/voices lists those uploaded)",
                                    status=404, param="name"))
        logger.info("Deleted voice %r", name)
        return JSONResponse({"success": True, "message": f"Voice '{name}' deleted successfully"})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(server.observe(), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def checked_speech(body: Body) -> SpeechInput:
        return await speech_input_fetched(body, config, server.prompt, server.max_prompt_tokens,
                                          server.reference_audio, server.voices)

    @app.post("/v1/audio/speech")
    async def speech(request: Request) -> Response:
        arrived = time.monotonic()
        try:
            got = await checked_speech(await request.body())
        except Refused as exc:
            return _refusal(exc)
        chunks = server.audio(got.job, arrived)
        if not got.stream:
            return await _whole(request, chunks, got, config.sample_rate)
        try:  # the first chunk before the status line: a request that fails before any audio gets a 5xx
            first = await anext(chunks, None)
        except StageFailed as exc:
            return _failure(exc)
        body = _sse(first, chunks, got, config.sample_rate) if got.sse else _raw(first, chunks, got, config.sample_rate)
        media = "text/event-stream" if got.sse else audio.MEDIA_TYPES[got.response_format]
        return StreamingResponse(body, media_type=media, headers={"X-Request-Id": got.job.request_id})

    @app.post("/v1/audio/speech/batch")
    async def speech_batch(request: Request) -> Response:
        """vllm-omni's batch: the items spoken at once, each its own whole answer (base64) or its own error."""
        arrived = time.monotonic()
        try:
            bodies = batch_items(await request.body(), config)
        except Refused as exc:
            return _refusal(exc)
        checked = await asyncio.gather(*(_checked_or_refused(checked_speech, body) for body in bodies))
        return await _batch(request, server, checked, arrived)

    @app.websocket("/v1/audio/speech/stream")
    async def speech_stream(websocket: WebSocket) -> None:
        await serve_session(websocket, checked_speech, server.audio, config.sample_rate, config.max_input_chars)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        arrived = time.monotonic()
        if server.thinker_prompt is None:  # vLLM answers a model that cannot chat with a 404 too
            return _refusal(Refused("this pipeline has no thinker stage: it makes speech from text only "
                                    "(POST /v1/audio/speech); chat needs a thinker -> talker -> code2wav pipeline",
                                    status=404))
        try:
            got = chat_input(await request.body(), config, server.thinker_prompt, server.max_prompt_tokens,
                             server.vocab_sizes)
        except Refused as exc:
            return _refusal(exc)
        assert server.tokenizer is not None
        parts = server.answer(got.job, arrived)
        if not got.stream:
            return await _chat_whole(request, parts, got, server.tokenizer, config)
        try:  # the first part before the status line: a request that fails before it gets a 5xx
            first = await anext(parts, None)
        except StageFailed as exc:
            return _failure(exc)
        body = chat_sse(got, first, parts, TextDeltas(server.tokenizer), config.served_model_name, config.sample_rate)
        return StreamingResponse(body, media_type="text/event-stream", headers={"X-Request-Id": got.job.request_id})

    return app


MAX_FORM_OVERHEAD = 1 << 20  # a voice upload's form beyond its audio file: the text fields and part headers
UPLOAD_FIELDS = ("audio_sample", "speaker_embedding", "name", "consent", "ref_text", "speaker_description")


async def uploaded_voice(request: Request, voices: UploadedVoices | None,
                         embedding_size: int) -> dict[str, str | int]:
    """A voice upload's form checked and its clip, or its speaker embedding, kept (vllm-omni's `upload_voice`,
    `upload_voice_embedding`); `Refused` says why not."""
    if voices is None:
        raise Refused("this model does not clone voices (a Qwen3-TTS Base checkpoint does): it has no use for an "
                      "uploaded one", param="audio_sample")
    body = bytearray()  # read whole first, within bounds: Starlette's parser would spool a file of any size
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_UPLOAD_BYTES + MAX_FORM_OVERHEAD:
            raise Refused(f"the upload is over {MAX_UPLOAD_BYTES >> 20} MiB", param="audio_sample")

    async def whole() -> dict[str, Any]:
        return {"type": "http.request", "body": bytes(body), "more_body": False}

    try:
        form = await Request(request.scope, whole).form(max_files=1, max_fields=len(UPLOAD_FIELDS))
    except Exception as exc:  # noqa: BLE001 (Starlette's form parser: a malformed or over-full body)
        raise Refused(f"the body is not a multipart form of a voice upload ({', '.join(UPLOAD_FIELDS)}): "
                      f"{exc}") from None
    try:
        unknown = sorted(set(form.keys()) - set(UPLOAD_FIELDS))
        if unknown:
            raise Refused(f"not a voice upload's field: {', '.join(unknown)}", param=unknown[0])
        form_fields: dict[str, str] = {}
        for name in ("name", "consent", "ref_text", "speaker_description", "speaker_embedding"):
            value = form.get(name)
            if value is not None and not isinstance(value, str):
                raise Refused(f"{name} is a form field, not a file", param=name)
            if value is not None:
                form_fields[name] = value
        for name in ("name", "consent"):
            if name not in form_fields:
                raise Refused(f"{name} is required", param=name)
        sample = form.get("audio_sample")
        given_embedding = form_fields.get("speaker_embedding")
        if sample is not None and given_embedding is not None:
            raise Refused("audio_sample and speaker_embedding are two ways of giving the voice: give one",
                          param="speaker_embedding")
        try:
            if given_embedding is not None:
                voice = await asyncio.to_thread(voices.add_embedding, form_fields["name"], form_fields["consent"],
                                                uploaded_embedding(given_embedding, embedding_size))
            elif sample is None or isinstance(sample, str):
                raise Refused("audio_sample (the voice's audio file) or speaker_embedding is required",
                              param="audio_sample")
            else:
                data = await sample.read(MAX_UPLOAD_BYTES + 1)
                voice = await asyncio.to_thread(voices.add, form_fields["name"], form_fields["consent"], data,
                                                sample.filename or "", sample.content_type,
                                                form_fields.get("ref_text"), form_fields.get("speaker_description"))
        except BadUpload as exc:
            raise Refused(str(exc), param=exc.param) from None
        except OSError as exc:  # the voice directory: read-only, full, gone
            logger.error("Could not keep an uploaded voice in %s: %s", voices.directory, exc)
            raise Refused(f"the server could not keep the voice: {exc.strerror or exc}", status=500) from None
    finally:
        await form.close()
    what = (f"a {voice.embedding_dim}-wide speaker embedding" if voice.embedding_dim else
            f"{voice.sample_rate} Hz, {'with its transcript' if voice.ref_text else 'no transcript: its embedding alone'}")
    logger.info("Uploaded voice %r (consent %r, %s)", voice.name, voice.consent, what)
    return voice.uploaded()


def uploaded_embedding(text: str, size: int) -> np.ndarray:
    """An upload's `speaker_embedding` field: a JSON list of numbers, the talker's width (vllm-omni's checks)."""
    try:
        values = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise Refused(f"speaker_embedding must be JSON: {exc}", param="speaker_embedding") from None
    if (not isinstance(values, list) or not values or len(values) > MAX_EMBEDDING_SIZE
            or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)):
        raise Refused(f"speaker_embedding must be a JSON list of 1 to {MAX_EMBEDDING_SIZE} numbers",
                      param="speaker_embedding")
    return speaker_embedding(values, size)


async def _checked_or_refused(check: Callable[[Body], Awaitable[SpeechInput]], body: Body) -> SpeechInput | Refused:
    try:
        return await check(body)
    except Refused as exc:
        return exc
    except Exception as exc:  # noqa: BLE001 (a check that failed otherwise fails its item alone, as in vllm-omni)
        logger.exception("a batch item's check failed")
        return Refused(f"the server could not check the request ({type(exc).__name__}; its log has why)", status=500)


class BatchItemResult(TypedDict, total=False):
    """vllm-omni's `SpeechBatchItemResult`: the fields set (its answer omits the others)."""

    index: int
    status: str  # "success" | "error"
    audio_data: str  # the whole answer in its response_format, base64
    media_type: str
    usage: dict[str, Any]
    error: str


async def _batch(request: Request, server: SpeechServer, checked: list[SpeechInput | Refused],
                 arrived: float) -> Response:
    """vllm-omni's `BatchSpeechResponse`: an item refused or failed is its result's `error`; a client gone
    before the answer aborts every item (a 499)."""
    rate = server.config.sample_rate
    streams = {index: server.audio(got.job, arrived) for index, got in enumerate(checked) if isinstance(got, SpeechInput)}

    async def spoken(index: int, got: SpeechInput | Refused) -> BatchItemResult:
        if isinstance(got, Refused):
            return {"index": index, "status": "error", "error": str(got)}
        try:
            parts = [chunk async for chunk in streams[index]]
            samples = np.concatenate(parts) if parts else np.zeros(0, np.float32)
            body = await asyncio.to_thread(audio.encoded, samples, got.response_format, rate)
        except Exception as exc:  # noqa: BLE001 (one item's failure is its own, as in vllm-omni)
            if not isinstance(exc, StageFailed):
                logger.exception("batch item %d (%s) failed", index, got.job.request_id)
            return {"index": index, "status": "error", "error": str(exc)}
        return {"index": index, "status": "success", "audio_data": base64.b64encode(body).decode(),
                "media_type": audio.MEDIA_TYPES[got.response_format], "usage": usage(got.job)}

    async def every_item() -> list[BatchItemResult]:
        return list(await asyncio.gather(*(spoken(index, got) for index, got in enumerate(checked))))

    async def close_every_stream() -> None:
        for stream in streams.values():
            await stream.aclose()

    results = await _while_connected(request, every_item(), close_every_stream)
    if isinstance(results, Response):
        return results
    succeeded = sum(result["status"] == "success" for result in results)
    return JSONResponse({"id": f"speech-batch-{uuid.uuid4().hex}", "results": results, "total": len(results),
                         "succeeded": succeeded, "failed": len(results) - succeeded})


async def _collected(request: Request, parts: AsyncIterator[T]) -> list[T] | Response:
    """All of an iterator's items, or the answer without them: a 499 when the client went away first
    (which aborts its request), a 503 when a stage failed it."""

    async def collect() -> list[T]:
        return [p async for p in parts]

    try:
        return await _while_connected(request, collect(), parts.aclose)
    except StageFailed as exc:
        return _failure(exc)


async def _while_connected(request: Request, work: Awaitable[T], close: Callable[[], Awaitable[None]]) -> T | Response:
    """`work`'s result, or a 499 when the client went away first; work left unfinished (the client gone,
    or this handler cancelled) is stopped and `close` run, which aborts its requests."""
    task = asyncio.ensure_future(work)
    try:
        while not task.done():
            done, _ = await asyncio.wait({task}, timeout=0.1)
            if not done and await request.is_disconnected():
                return Response(status_code=499)
        return task.result()
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
            await close()


async def _chat_whole(request: Request, parts: AsyncIterator[Part], got: ChatInput, tokenizer: Tokenizer,
                      config: ServeConfig) -> Response:
    collected = await _collected(request, parts)
    if isinstance(collected, Response):
        return collected
    chunks = [p for p in collected if isinstance(p, np.ndarray)]
    text = tokenizer.decode(got.job.text_ids, skip_special_tokens=True) if "text" in got.modalities else None
    samples = (np.concatenate(chunks) if chunks else np.zeros(0, np.float32)) if got.job.speak else None
    answer = await asyncio.to_thread(completion, got, text, samples, config.served_model_name, config.sample_rate)
    return JSONResponse(answer, headers={"X-Request-Id": got.job.request_id})


async def _whole(request: Request, chunks: AsyncIterator[np.ndarray], got: SpeechInput, rate: int) -> Response:
    """All the audio in one body; a client gone before it is made aborts the request."""
    parts = await _collected(request, chunks)
    if isinstance(parts, Response):
        return parts
    samples = np.concatenate(parts) if parts else np.zeros(0, np.float32)
    # Off the event loop: an MP3 or Opus of a long answer takes a while, and other streams wait on the loop.
    body = await asyncio.to_thread(audio.encoded, samples, got.response_format, rate)
    return Response(body, media_type=audio.MEDIA_TYPES[got.response_format],
                    headers={"X-Request-Id": got.job.request_id})


async def _raw(first: np.ndarray | None, chunks: AsyncIterator[np.ndarray], got: SpeechInput,
               rate: int) -> AsyncIterator[bytes]:
    try:
        if got.response_format == "wav":
            yield audio.wav_header(rate, None)
        if first is not None:
            yield audio.pcm16(first)
        async for chunk in chunks:
            yield audio.pcm16(chunk)
    except StageFailed as exc:  # the status line is out: the stream ends short, the log says why
        logger.error("speech request %s failed mid-stream: %s", got.job.request_id, exc)
    finally:
        await chunks.aclose()


async def _sse(first: np.ndarray | None, chunks: AsyncIterator[np.ndarray], got: SpeechInput,
               rate: int) -> AsyncIterator[str]:
    """vllm-omni's (OpenAI's) `speech.audio.*` events: base64 PCM deltas, then done or error. As
    vllm-omni sends a WAV: its header the first delta, so the deltas joined are a WAV file."""

    def event(kind: str, payload: dict[str, Any]) -> str:
        return f"event: {kind}\ndata: {json.dumps({'type': kind, **payload}, separators=(',', ':'))}\n\n"

    def delta(data: bytes) -> str:
        return event("speech.audio.delta", {"audio": base64.b64encode(data).decode("ascii"),
                                            "response_format": got.response_format})

    sent = False
    try:
        if first is not None:
            sent = True
            if got.response_format == "wav":
                yield delta(audio.wav_header(rate, None))
            yield delta(audio.pcm16(first))
        async for chunk in chunks:
            sent = True
            yield delta(audio.pcm16(chunk))
        yield event("speech.audio.done", {"usage": usage(got.job)})
    except StageFailed as exc:
        error = {"message": str(exc), "type": "server_error", "param": None, "code": 503}
        if sent:
            error.update(partial_audio=True, action="discard")
        yield event("speech.audio.error", {"error": error})
    finally:
        await chunks.aclose()
