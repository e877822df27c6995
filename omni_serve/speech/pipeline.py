"""One speech request through [thinker ->] talker -> code2wav, every stage running free.

With a thinker stage (the demo's three-stage shape) the request's prompt is the thinker's: it runs
whole in the thinker's engine, then what it made (a `ThinkerOutput`: its sidecar's assembled
outputs, such as the last layer's `hidden_states` or the captured layers `hidden_states.layer_N`,
one row per token it ran, and its prompt and output ids) becomes the talker's prompt and payload
(`talker_prompt`, the config's function), as examples/demo.py's `--by-hand` run and vllm-omni's
non-streaming thinker -> talker hand-over hand them over.
The talker therefore starts when the thinker has finished: its rows are not streamed into a
running talker request (upstream V2 cannot hold a request waiting for its next rows). The thinker's
tokens are the job's text (a chat answer's, handed on delta by delta); a job not spoken (a chat
answer in text only) ends with the thinker.

The talker request is added whole (its text is known up front) and runs as vLLM schedules it.
Its codec frames are read from the talker's sidecar (the assembled `codes.audio`, which a hot
upgrade hands over whole) after each of its engine outputs. Each chunk of frames becomes its own one-step code2wav request, added as
soon as the chunk's frames are there: its payload holds a window of the frames ending with the
chunk (its left context among them) and `meta.codec_next_chunk`, the chunk of that window the
omni-code2wav hook set decodes. A voice-cloning request's reference codes (vllm-omni's Base talker's
`codes.ref` in context mode) come before its first frame: the left context of its first chunks, never
audio of the answer (as vllm-omni's talker -> code2wav hand-over prepends them). So code2wav never waits inside the engine (no step spent on a request whose
codes are not there yet, no driver gating steps), chunks of one request overlap the talker and
each other, and the audio comes out chunk by chunk, read from the code2wav sidecar.

Upstream's streaming input (`AsyncLLM.generate` fed `StreamingInput`s; vLLM 0.15 and later) would
hold one code2wav request between chunks instead, but with the shim as it is each resumed turn
reaches the worker as a new request under the same id (the sidecar admits it again), the shim's
length watch reports each turn's end as a finish, and the session's end is an abort the worker
learns only at the engine's next step: not used here.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, Callable, TypeVar

import numpy as np
from vllm import SamplingParams
from vllm.exceptions import VLLMValidationError
from vllm.logger import init_logger
from vllm.sampling_params import RequestOutputKind

from omni_serve.speech.handover import TalkerPrompt, ThinkerOutput
from omni_serve.stages.link import AsyncSidecarClient, RequestRejected, SidecarLost
from omni_serve.stages.payload import additional_information
from proto.chunk_grid import ChunkGrid
from proto.settings import REF_CODE_LEN, REF_CODES

logger = init_logger(f"vllm.{__name__}")  # under vLLM's logger: its handler, format and VLLM_LOGGING_LEVEL

CODES = "codes.audio"  # the talker sidecar's assembled output: [frames, Q] codec frames
WAVEFORM = "waveform"  # the code2wav sidecar's assembled output: [samples, 1] float32
FOLLOW_TIMEOUT_S = 30.0  # a stage whose sidecar has not finished a request this long after its engine did
RELEASE_TIMEOUT_S = 60.0
ALL_SEEN = 1 << 40  # a cursor past every chunk: asks only whether the request is known and finished
T = TypeVar("T")


class StageFailed(RuntimeError):
    """A stage could not serve the request (its sidecar lost, its engine failed)."""

    def __init__(self, stage: str, message: str) -> None:
        super().__init__(f"{stage}: {message}")
        self.stage = stage


# What SamplingParams raises for fields it refuses (VLLMValidationError is a ValueError in vLLM 0.26, not 0.32).
SAMPLING_REFUSALS = (TypeError, ValueError, OverflowError, VLLMValidationError)


def stage_sampling(base: dict[str, Any], seed: int | None, requested: dict[str, Any], max_tokens: int,
                   extra_args: dict[str, Any] | None) -> SamplingParams:
    """A thinker's or talker's request sampling: the pipeline file's `base`, the request's seed and
    `requested` fields over it, the pipeline's own (max_tokens, detokenize, output_kind, extra_args) over
    all: its tokens are read as ids (detokenized, where text is wanted, by the front end), as deltas."""
    return SamplingParams(**{**base, "seed": seed, **requested, "max_tokens": max_tokens, "detokenize": False,
                             "output_kind": RequestOutputKind.DELTA, "extra_args": extra_args})


@dataclass
class SpeechJob:
    """What one request asks for."""

    request_id: str
    prompt_token_ids: list[int]
    payload: dict[str, Any]
    max_frames: int
    seed: int | None = None
    input_tokens: int = 0  # the text's tokens as the first stage reads them (usage)
    reference_tokens: int = 0  # a voice clone's reference codec frames the talker reads (usage's audio tokens)
    # The request's SamplingParams fields per stage name, over the pipeline file's (`stage_sampling`)
    sampling: dict[str, dict[str, Any]] = field(default_factory=dict)
    frames: int = 0  # codec frames the talker made (usage), set when it has finished
    # With a thinker stage: whether its answer is spoken (False: a chat answer in text only, no
    # talker), at most how many tokens it makes (0: its stage's max_tokens), the tokens it made
    # and why it stopped, and a callback given each of its deltas as they come (a streamed answer).
    speak: bool = True
    max_text_tokens: int = 0
    text_ids: list[int] = field(default_factory=list)
    text_finish: str | None = None
    on_text: Callable[[list[int]], None] | None = None


@dataclass
class Stage:
    name: str
    engine: Any  # vllm.v1.engine.async_llm.AsyncLLM
    link: AsyncSidecarClient
    sampling: dict[str, Any] = field(default_factory=dict)
    in_flight: int = 0  # requests in this stage's engine now (the talker's: one per speech request; code2wav's: one per chunk)
    # Resolved with the reason when the stage's sidecar is lost: every request served meanwhile fails.
    _loss: asyncio.Future[str] | None = field(default=None, init=False, repr=False)

    async def serve(self, work: Awaitable[T]) -> T:
        """One request's work in this stage. If the stage's sidecar is lost meanwhile, StageFailed at
        once (what the sidecar held of the request is gone; its engine finishing it would leave the
        request waiting on a sidecar that never heard of it) and the work is cancelled, which closes
        its engine generator and so aborts the request in the engine."""
        if self._loss is None:
            self._loss = asyncio.get_running_loop().create_future()
        loss, task = self._loss, asyncio.ensure_future(work)
        try:
            await asyncio.wait((task, loss), return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            stop_soon(task)
            raise
        if not task.done():
            stop_soon(task)
            raise StageFailed(self.name, loss.result())
        return task.result()

    def fail_served(self, reason: str) -> None:
        """Every request being served in the stage fails now with the reason (its sidecar is gone, the
        server is shutting down); later ones are served as usual."""
        if self._loss is not None and not self._loss.done():
            self._loss.set_result(reason)
        self._loss = None


@dataclass
class Frames:
    """The talker's frames of one request as they come."""

    codes: np.ndarray | None = None  # [frames, Q]: the talker sidecar's assembled codes so far (in the codebook)
    reference: np.ndarray | None = None  # [frames, Q]: the codes of a voice-cloning request's reference audio
    ended: bool = False
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    # The codec's codebook size (0: every frame is one): a frame with a code outside it is not
    # audio (a talker's stop frame, as vllm-omni's talker -> code2wav hand-overs drop it).
    codebook_size: int = 0

    @property
    def count(self) -> int:
        return 0 if self.codes is None else int(self.codes.shape[0])

    def set(self, codes: np.ndarray | None) -> None:
        if codes is not None and self.codebook_size and codes.ndim == 2:
            codes = codes[((codes >= 0) & (codes < self.codebook_size)).all(axis=1)]
        if codes is not None and codes.shape[0] > self.count:  # frames only ever grow
            self.codes = codes
            self.changed.set()

    def all(self) -> np.ndarray:
        assert self.codes is not None
        return self.codes

    def set_reference(self, outputs: dict[str, Any]) -> None:
        """The reference codes in the talker's outputs, once (they come with its first step's), cropped
        to their length as vllm-omni's talker -> code2wav hand-over crops them (a talker that publishes
        them every step, as vllm-omni's does without async chunk, has them assembled several times)."""
        codes, length = outputs.get(REF_CODES), outputs.get(REF_CODE_LEN)
        if self.reference is not None or codes is None or codes.ndim != 2 or length is None:
            return
        self.reference = codes[: int(np.asarray(length).reshape(-1)[0])]

    @property
    def reference_count(self) -> int:
        return 0 if self.reference is None else int(self.reference.shape[0])

    def window(self, first: int, end: int) -> np.ndarray:
        """Frames [first, end) of the reference codes followed by the answer's: only the window copied,
        never the whole sequence (a chunk's payload is a few chunks of a long answer)."""
        before = self.reference_count
        answer = self.all()[max(0, first - before):max(0, end - before)]
        if self.reference is None or first >= before:
            return answer
        return np.concatenate([self.reference[first:min(end, before)].astype(answer.dtype), answer])


async def engine_outputs(stage: "Stage", outputs: AsyncIterator[Any]) -> AsyncIterator[Any]:
    """A stage engine's outputs for one request; its failure as a StageFailed. Closing this closes
    the engine's generator, which aborts the request in that engine."""
    async with contextlib.aclosing(outputs):
        try:
            async for out in outputs:
                yield out
        except StageFailed:
            raise
        except Exception as exc:  # EngineDeadError, EngineGenerateError, a failed input stream
            raise StageFailed(stage.name, f"its engine failed the request: {type(exc).__name__}: {exc}") from None


def stop_soon(task: asyncio.Task) -> None:
    """Cancel a task without waiting for it; whatever it ends with is read (never logged as lost)."""
    task.cancel()
    task.add_done_callback(lambda t: t.cancelled() or t.exception())


async def patiently(stage: str, never: str) -> AsyncIterator[None]:
    """Turns of a wait for a sidecar to finish what its engine has finished (a step's results reach
    it just after the step): at once, then ever less often (2 ms doubling to 50 ms), so many waiting
    requests do not flood it with queries; StageFailed after FOLLOW_TIMEOUT_S."""
    deadline, pause = time.monotonic() + FOLLOW_TIMEOUT_S, 0.002
    while True:
        yield
        if time.monotonic() > deadline:
            raise StageFailed(stage, never)
        await asyncio.sleep(pause)
        pause = min(pause * 2, 0.05)


@dataclass
class ThinkerStage:
    """The stage before the talker and how its output becomes the talker's input."""

    stage: Stage
    max_tokens: int
    talker_prompt: TalkerPrompt  # its ThinkerOutput -> the talker's prompt ids, payload
    model: str  # its checkpoint (ThinkerOutput.model)


@dataclass
class SpeechPipeline:
    talker: Stage
    code2wav: Stage
    chunks: ChunkGrid  # how the codes are cut (the code2wav sidecar's chunk_frames, initial_chunk_frames)
    left_context: int
    placeholder_token: int
    thinker: ThinkerStage | None = None
    codebook_size: int = 0  # the code2wav sidecar's (its option; 0: unchecked): Frames.codebook_size
    # Each stage's share of a request's first audio, (stage, seconds): the thinker's whole request,
    # the talker's start to its first chunk's frames, code2wav's first chunk request to its waveform.
    first_audio_share: Callable[[str, float], None] = lambda stage, seconds: None
    # A request's codes [frames, Q] and its reference codes (None: no voice cloned from audio), once
    # it has been served whole (omni-serve --codes-log).
    finished_codes: Callable[[str, np.ndarray, np.ndarray | None], None] | None = None
    _releases: set[asyncio.Task] = field(default_factory=set, init=False, repr=False)

    @property
    def stages(self) -> tuple[Stage, ...]:
        first = (self.thinker.stage,) if self.thinker is not None else ()
        return (*first, self.talker, self.code2wav)

    async def synthesize(self, job: SpeechJob) -> AsyncIterator[np.ndarray]:
        """The request's audio, float32 mono chunks in order. Stopping the iteration (a client gone)
        aborts the request in both engines and drops what the sidecars kept for it."""
        frames = Frames(codebook_size=self.codebook_size)
        talker_task: asyncio.Task | None = None
        try:
            talker_job = job
            if self.thinker is not None:
                made = await self._run_thinker(job, self.thinker)
                if not job.speak:
                    return
                talker_job = await self._talker_job(job, made, self.thinker)
            talker_task = asyncio.create_task(self._run_talker(talker_job, frames))
            async with contextlib.aclosing(self._run_code2wav(job, frames, talker_task)) as audio:
                async for chunk in audio:
                    yield chunk
            await talker_task  # its failure, if it failed after its last frame
            if self.finished_codes is not None and frames.count:
                self.finished_codes(job.request_id, frames.all(), frames.reference)
        finally:
            # No await in here: a client gone cancels the handler's scope, and every await in it
            # would raise again before the rest ran. The tasks end themselves (aborting their
            # requests); the releases run on their own.
            job.frames = frames.count
            if talker_task is not None:
                stop_soon(talker_task)
            for stage in self.stages:
                if stage is not self.code2wav:  # its requests are the chunks' (released as each ends)
                    self._release(stage, job.request_id)

    def _release(self, stage: Stage, request_id: str, finished: bool = False) -> None:
        """Drop what the stage's sidecar keeps of a request once it has finished there (an aborted
        request finishes in the sidecar only after its engine's next step); `finished`: it has (it
        was read finished), so it is dropped without asking first."""
        drop = self._drop(stage, request_id) if finished else self._drop_when_finished(stage, request_id)
        task = asyncio.get_running_loop().create_task(drop)
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)

    async def _drop_when_finished(self, stage: Stage, request_id: str) -> None:
        deadline = time.monotonic() + RELEASE_TIMEOUT_S
        try:
            while time.monotonic() < deadline:
                got, _ = await stage.link.follow(request_id, ALL_SEEN)
                if not got.found or got.finished:
                    await stage.link.forget(request_id)
                    return
                await asyncio.sleep(0.05)
            logger.warning("%s: request %s never finished in its sidecar; its outputs stay there", stage.name,
                           request_id)
        except (SidecarLost, RequestRejected):
            await self._drop(stage, request_id)  # a failed request's record; a lost sidecar kept nothing

    @staticmethod
    async def _drop(stage: Stage, request_id: str) -> None:
        with contextlib.suppress(SidecarLost, RequestRejected):
            await stage.link.forget(request_id)

    async def close(self) -> None:
        for task in list(self._releases):
            task.cancel()
        await asyncio.gather(*self._releases, return_exceptions=True)

    async def _outputs(self, stage: Stage, request_id: str) -> tuple[dict[str, Any], bool]:
        """The request's assembled outputs in the stage's sidecar so far, and whether it has finished there."""
        try:
            values, got = await stage.link.outputs(request_id)
        except SidecarLost as exc:
            raise StageFailed(stage.name, str(exc)) from None
        except RequestRejected as exc:
            raise StageFailed(stage.name, f"its hooks failed the request: {exc}") from None
        return values, got.finished

    async def _assembled(self, stage: Stage, request_id: str, name: str) -> tuple[np.ndarray | None, bool]:
        values, finished = await self._outputs(stage, request_id)
        return values.get(name), finished

    async def _run_thinker(self, job: SpeechJob, thinker: ThinkerStage) -> ThinkerOutput:
        """The thinker's request, run whole: what it made (its tokens also in `job.text_ids`)."""
        stage = thinker.stage
        started = time.monotonic()
        extra = {"omni_sidecar": {"additional_information": additional_information(job.payload)}} if job.payload else None
        params = stage_sampling(stage.sampling, job.seed, job.sampling.get(stage.name, {}),
                                job.max_text_tokens or thinker.max_tokens, extra)

        async def outputs() -> ThinkerOutput:
            prompt_ids: list[int] = job.prompt_token_ids
            async for out in engine_outputs(stage, stage.engine.generate({"prompt_token_ids": job.prompt_token_ids},
                                                                         params, job.request_id)):
                self._check_output(stage.name, out)
                if out.prompt_token_ids:  # as the engine ran it (copied once, below)
                    prompt_ids = out.prompt_token_ids
                if out.outputs:
                    delta = list(out.outputs[0].token_ids)
                    job.text_ids += delta
                    job.text_finish = out.outputs[0].finish_reason
                    if delta and job.on_text is not None:
                        job.on_text(delta)
            prompt_ids = list(prompt_ids)
            if not job.speak:  # its hidden rows are for the talker: none here
                return ThinkerOutput({}, prompt_ids, list(job.text_ids), thinker.model, dict(job.payload))
            # Its last step's rows reach the sidecar after the engine's last output.
            async for _ in patiently(stage.name, "its sidecar never finished the request's hidden states"):
                values, finished = await self._outputs(stage, job.request_id)
                if finished:
                    arrays = {name: np.ascontiguousarray(v, dtype=np.float32) if v.dtype.kind == "f" else v
                              for name, v in values.items() if isinstance(v, np.ndarray)}
                    return ThinkerOutput(arrays, prompt_ids, list(job.text_ids), thinker.model, dict(job.payload))
            raise AssertionError("unreachable: patiently() raises when it gives up")

        stage.in_flight += 1
        try:
            made = await stage.serve(outputs())
        finally:
            stage.in_flight -= 1
        if job.speak:
            self.first_audio_share(stage.name, time.monotonic() - started)
        return made

    async def _talker_job(self, job: SpeechJob, made: ThinkerOutput, thinker: ThinkerStage) -> SpeechJob:
        """The talker's job made from what the thinker made (the config's `talker_prompt`)."""
        stage = thinker.stage
        rows = made.rows()
        prompt_len = len(made.prompt_ids)
        if not any(v.shape[0] >= prompt_len for v in rows.values()):
            shapes = {name: list(v.shape) for name, v in made.outputs.items()}
            raise StageFailed(stage.name, f"its sidecar has no hidden rows for the request's {prompt_len} prompt "
                                          f"tokens ({shapes})")
        try:
            # Off the event loop: it may read the thinker's checkpoint and run vllm-omni's hand-over.
            prompt_ids, payload = await asyncio.to_thread(thinker.talker_prompt, made)
        except ValueError as exc:
            raise StageFailed(stage.name, f"its hand-over to the talker failed: {exc}") from None
        return SpeechJob(job.request_id, prompt_ids, payload, job.max_frames, job.seed, sampling=job.sampling)

    async def _run_talker(self, job: SpeechJob, frames: Frames) -> None:
        started, first_chunk_seen = time.monotonic(), False

        def note_first_chunk(ended: bool) -> None:
            """The talker's share, once: when its first chunk's frames are there (a request shorter
            than one chunk: when it has finished)."""
            nonlocal first_chunk_seen
            if not first_chunk_seen and self.chunks.ready(0, frames.count, ended):
                first_chunk_seen = True
                self.first_audio_share(self.talker.name, time.monotonic() - started)

        async def all_frames() -> None:
            prompt = {"prompt_token_ids": job.prompt_token_ids}
            tokens = 0  # the talker's tokens so far: one per frame it has begun (its frames trail them)
            async for out in engine_outputs(self.talker, self.talker.engine.generate(prompt, params, job.request_id)):
                if out.finished and out.outputs and out.outputs[0].finish_reason not in ("length", "stop"):
                    raise StageFailed("talker", f"the engine ended the request ({out.outputs[0].finish_reason})")
                if out.finished or not out.outputs:
                    continue  # the last frames are read below, once the sidecar has them all
                tokens += len(out.outputs[0].token_ids)
                # The sidecar is asked only once the next chunk can be whole, and on each output
                # after until it is: a query per engine output, for every stream, is front-end and
                # sidecar work that grows with the concurrency while no chunk is any nearer.
                if tokens >= self.chunks.end(self.chunks.complete(frames.count)):
                    outputs, _ = await self._outputs(self.talker, job.request_id)
                    frames.set_reference(outputs)  # before the frames: chunk 0 takes it as context
                    frames.set(outputs.get(CODES))
                    note_first_chunk(ended=False)
            # The last steps' frames reach the sidecar after the engine's last output.
            async for _ in patiently("talker", "its sidecar never finished the request's codes"):
                outputs, finished = await self._outputs(self.talker, job.request_id)
                frames.set_reference(outputs)
                frames.set(outputs.get(CODES))
                note_first_chunk(ended=finished)
                if finished:
                    break

        self.talker.in_flight += 1
        try:  # from here on the frames end however the talker does: the code2wav side waits on them
            try:
                params = stage_sampling(self.talker.sampling, job.seed, job.sampling.get(self.talker.name, {}),
                                        job.max_frames,
                                        {"omni_sidecar": {"additional_information": additional_information(job.payload)}})
            except SAMPLING_REFUSALS as exc:  # the front end's checks let one through: the request's failure
                raise StageFailed(self.talker.name, f"its sampling was refused: {exc}") from None
            await self.talker.serve(all_frames())
        finally:
            self.talker.in_flight -= 1
            frames.ended = True
            frames.changed.set()

    def _ready_chunks(self, frames: Frames) -> int:
        return self.chunks.count(frames.count) if frames.ended else self.chunks.complete(frames.count)

    def _chunk_payload(self, frames: Frames, k: int) -> dict[str, Any]:
        """Chunk k's request: the chunk's frames and the left context before them (the reference codes
        first, where a voice-cloning request has them), as a window of two chunks, the context and the
        chunk: the hook set decodes the second (`codec_next_chunk` 1) and cuts the context's samples, as
        it would in the whole codes. Its payload stays a chunk and a context long however long the audio."""
        begins = frames.reference_count
        start, end = begins + self.chunks.start(k), begins + min(frames.count, self.chunks.end(k))
        first = max(0, start - self.left_context)
        context = start - first  # 0: the window is the chunk alone, its chunk 0
        return additional_information({"codes": {"audio": frames.window(first, end).astype(np.int64)},
                                       "meta": {"codec_next_chunk": 1 if context else 0,
                                                "codec_chunk_frames": end - start,
                                                "initial_codec_chunk_frames": context,
                                                "codec_left_context_frames": self.left_context}})

    def _code2wav_params(self, payload: dict[str, Any] | None) -> SamplingParams:
        extra = {"omni_sidecar": {"additional_information": payload}} if payload is not None else None
        return SamplingParams(**{**self.code2wav.sampling, "max_tokens": 1, "temperature": 0.0, "ignore_eos": True,
                                 "detokenize": False, "output_kind": RequestOutputKind.DELTA, "extra_args": extra})

    async def _run_code2wav(self, job: SpeechJob, frames: Frames, talker_task: asyncio.Task) -> AsyncIterator[np.ndarray]:
        """Chunk k's audio in order, each chunk decoded by its own code2wav request, started as soon as
        its frames are there (so chunks of one request overlap the talker and each other)."""
        chunks: list[asyncio.Task] = []
        try:
            k = 0  # the next chunk to hand out
            while True:
                frames.changed.clear()
                if talker_task.done() and not talker_task.cancelled() and talker_task.exception() is not None:
                    raise talker_task.exception()  # type: ignore[misc]
                while len(chunks) < self._ready_chunks(frames):
                    n = len(chunks)
                    chunks.append(asyncio.create_task(self._decode_chunk(f"{job.request_id}-c{n}",
                                                                         self._chunk_payload(frames, n), n == 0)))
                if k < len(chunks) and chunks[k].done():
                    for wave in chunks[k].result():
                        yield wave.reshape(-1)
                    k += 1
                    continue
                if frames.ended and k >= self.chunks.count(frames.count):
                    return
                waits = [chunks[k]] if k < len(chunks) else []
                if not frames.ended:
                    waits.append(asyncio.ensure_future(frames.changed.wait()))
                done, pending = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
                for waiter in pending:
                    if waiter not in chunks:
                        waiter.cancel()
        finally:
            for task in chunks:
                stop_soon(task)

    async def _decode_chunk(self, chunk_id: str, payload: dict[str, Any], first: bool) -> list[np.ndarray]:
        """One chunk through code2wav: a one-step request, its waveform read from the sidecar."""
        started = time.monotonic()

        async def waveform() -> list[np.ndarray]:
            prompt = {"prompt_token_ids": [self.placeholder_token]}
            async for out in engine_outputs(self.code2wav, self.code2wav.engine.generate(
                    prompt, self._code2wav_params(payload), chunk_id)):
                self._check_output("code2wav", out)
            async for _ in patiently("code2wav", "its sidecar never finished a chunk's waveform"):
                wave, finished = await self._assembled(self.code2wav, chunk_id, WAVEFORM)
                if finished:
                    if first:
                        self.first_audio_share(self.code2wav.name, time.monotonic() - started)
                    return [] if wave is None else [wave]
            raise AssertionError("unreachable: patiently() raises when it gives up")

        self.code2wav.in_flight += 1
        read = False  # its waveform read, finished in the sidecar
        try:
            got = await self.code2wav.serve(waveform())
            read = True
            return got
        finally:
            self.code2wav.in_flight -= 1
            self._release(self.code2wav, chunk_id, finished=read)

    @staticmethod
    def _check_output(stage: str, out: Any) -> None:
        if out.finished and out.outputs and out.outputs[0].finish_reason not in ("length", "stop", None):
            raise StageFailed(stage, f"the engine ended the request ({out.outputs[0].finish_reason})")
