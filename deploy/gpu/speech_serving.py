"""Speech serving side by side: vllm-omni 0.26's own server and omni-serve, one GPU, same requests.

  python3 deploy/gpu/speech_serving.py --model DIR --work DIR --result OUT/speech-serving.json
      [--limit-s S] [--servers vllm-omni,ours] [--levels 1,16,64] [--frames N]
      [--clone]   (a Base checkpoint: each request clones the voice of reference audio, two references)
      [--ours-pipeline TOML [--voices A,B]]   (ours on that config instead, with its voices: the CPU
      check, deploy/speech/tiny.toml; Qwen3-Omni, deploy/speech/qwen3-omni-gpu.toml from run_qwen3_omni.sh)

The model: the tiny Qwen3-TTS checkpoint of the published layout (tests/tiny_models/qwen3_tts.py),
given two CustomVoice speakers here (`with_speakers`), so a plain {"input", "voice"} request is
valid on both servers (the checkpoint as built is a VoiceDesign one, whose requests vllm-omni
answers only with `instructions`, which omni-serve's speech API refuses).

vllm-omni: `python3 -m vllm_omni.entrypoints.cli.main serve DIR --omni --deploy-config Y` (its
`vllm-omni` console script), Y its own deploy/qwen3_tts.yaml (talker -> code2wav through its
shared-memory connector, async chunk, its first audio chunk after 1 frame) with these changes:
memory fractions small and KV caches of a fixed size (both servers share the GPU), the tiny
checkpoint's 1024 positions and the talker's step budget (4096, as ours; code2wav's as shipped), greedy
everywhere (code 0 by the sampler, the code predictor's codes with do_sample false) and exactly
--frames frames a request on both (`exact_frames`: the request's max_new_tokens, min_tokens, the
codec EOS a stop token).
Its processes are vllm-omni's own, its patches applied.

ours: `python3 -m omni_serve --pipeline T`, T a talker -> code2wav config for vllm-omni's own
classes through the shim (VLLM_PLUGINS=omni_sidecar_shim: no vllm-omni patch), each stage an
AsyncLLM (V2, async scheduling as vLLM defaults it) with its sidecar (`omni-talker`,
`omni-code2wav` decoding vllm-omni's chunks: the first a frame long, then 25 frames, 72 of left context), the prompt
built as vllm-omni's server builds it (omni_serve/speech/qwen3_tts.py's `Qwen3TTSPrompt`, as
omni-serve --pipeline qwen3-tts serves a published checkpoint: the voices are the checkpoint's speakers).

Checks and figures:
- the servers start at once and get the run's limit to come up, less what the measurement needs
  (MEASURE_MIN_S, STOP_RESERVE_S);
- the same requests (non-streaming pcm, one at a time, each asked twice of each server: a
  server that disagrees with itself shows) to both: the waveforms compared sample by sample (max
  abs diff over int16 full scale; bound WAVEFORM_RTOL x vllm-omni's peak), and their codec codes
  (`codes_identical`, CODES_NOTE says how they are read: neither server returns codes over HTTP);
- per concurrency level (1, 16, 64 streaming requests at once, `stream_format: audio`, pcm; a round
  is 2 x that many requests, at least 8): one untimed warm-up round per server, then timed blocks of
  rounds, each server twice, ABBA then BAAB (bench/ab_stats.py), as many as the level's share of the
  time left allows (--max-blocks at most). Per server: TTFA p50/p95 over all timed requests (POST to
  the first audio bytes), audio seconds per second (their audio over their rounds' wall time), RTF
  (median of each request's time over its audio's length), each with its spread over the rounds
  (`spread`: median, min..max, bootstrap 95 % interval of the median); omni-serve's first-audio
  share per stage over its timed rounds; per level, ours over vllm-omni per block (TTFA p95, audio
  s/s: `ours_over_vllm_omni`, median and bootstrap interval over the blocks).
The run stops cleanly at --limit-s with what it has (`complete`: false), the servers stopped.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))

from bench.ab_stats import MIN_BLOCKS_TO_RESOLVE, block_order, bootstrap_median  # noqa: E402
from codes_probe import RECORDING_CONNECTOR, probe_site, read_probe  # noqa: E402
from omni_serve.speech.codes_log import read_codes_log  # noqa: E402

SERVERS = ("ours", "vllm-omni")
# CustomVoice speakers added to the tiny checkpoint (with_speakers): codec ids past the tiny talker's
# specials (64..71), inside its vocabulary of 80.
VOICES = {"vivian": 72, "ryan": 73}
# With --clone (a Base checkpoint, tests/tiny_models/qwen3_tts.py's build_base): the "voices" requests take
# in turn are references, each a clip (noise, 1.5 s at 24 kHz, seeded) and its transcript, sent inline as
# vllm-omni's clients send them (ref_audio a base64 data URL); filled in by `references`.
REFERENCES: dict[str, dict] = {}
REFERENCE_SECONDS = 1.5
LEVELS = (1, 16, 64)
WAVEFORM_RTOL = 0.05  # bf16 decoders on different batch shapes (deploy/gpu/parity.py's CODE2WAV_RTOL)
TEXTS = ["Hello there, this is a test of the speech server.", "Short one.",
         "The quick brown fox jumps over the lazy dog, twice, to be sure.", "Numbers: one two three four five."]
SAMPLE_RATE = 24000  # both servers' pcm: 16-bit mono at the codec's rate
STOP_RESERVE_S = 25  # kept back from the limit for stopping the servers and writing the results
# Kept back from the limit for what follows the servers' start: the warm-up requests, the waveform
# check and each level's warm-up rounds and one block (the servers wait for their start up to the
# rest of the limit: vllm-omni's own takes about 300 s on the H200, ours about 90 s).
MEASURE_MIN_S = 60
CODES_NOTE = (
    "the codes of the waveform requests' first asks (each request asked twice of each server, one at a time): "
    "omni-serve's from its --codes-log, vllm-omni's as its talker hands them to its code2wav, recorded by a "
    "connector added to its own connector registry (deploy/gpu/codes_probe.py)")
# Timed blocks per level at most (each: every server twice, ABBA then BAAB), as time allows: as many as a
# ratio's bootstrap interval needs to mean anything (bench/ab_stats.py).
MAX_BLOCKS = MIN_BLOCKS_TO_RESOLVE
STOP_WAIT_S = 15  # a server not gone this long after SIGINT (its engines included) is killed
# Fixed KV cache sizes: four engines start at once on one GPU, and vLLM's memory profiling of one
# would count the others' allocations as its own (deploy/gpu/parity.py starts its engines so too).
TALKER_KV_BYTES = 1 << 30
CODE2WAV_KV_BYTES = 1 << 29


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- the model and the two servers' configs ----

def with_speakers(model: Path) -> None:
    """The checkpoint as a CustomVoice one with VOICES (their codec rows are in the talker's embedding)."""
    path = model / "config.json"
    config = json.loads(path.read_text())
    config["tts_model_type"] = "custom_voice"
    config["talker_config"]["spk_id"] = dict(VOICES)
    config["talker_config"]["spk_is_dialect"] = {name: False for name in VOICES}
    path.write_text(json.dumps(config, indent=1))


def exact_frames(model: Path, frames: int) -> dict:
    """Sampling that makes exactly `frames` frames, none of them the codec's EOS: the EOS a stop
    token, masked until `min_tokens` (vLLM's, V1 and V2 alike); the talker class masks the other
    specials itself. (With `ignore_eos` a greedy random talker would sample the EOS mid-stream, and
    an EOS frame is no code the decoder can take.)"""
    eos = json.loads((model / "config.json").read_text())["talker_config"]["codec_eos_token_id"]
    return {"max_tokens": frames, "min_tokens": frames, "stop_token_ids": [int(eos)]}


def codec_codebooks(model: Path) -> int:
    """Codebooks a codec frame has (the talker's code groups)."""
    return int(json.loads((model / "config.json").read_text())["talker_config"]["num_code_groups"])


def vllm_omni_deploy(work: Path, model: Path, frames: int) -> Path:
    """vllm-omni's own deploy/qwen3_tts.yaml, changed as the module's docstring says."""
    import yaml

    spec = importlib.util.find_spec("vllm_omni")  # its folder; the package itself is not imported here
    assert spec is not None and spec.submodule_search_locations, "vllm-omni is not installed"
    shipped = Path(list(spec.submodule_search_locations)[0]) / "deploy" / "qwen3_tts.yaml"
    deploy = yaml.safe_load(shipped.read_text())
    talker, code2wav = deploy["stages"]
    for stage, kv_bytes in ((talker, TALKER_KV_BYTES), (code2wav, CODE2WAV_KV_BYTES)):
        stage.update(gpu_memory_utilization=0.12, max_num_seqs=64, kv_cache_memory_bytes=kv_bytes)
    # The tiny checkpoint's talker and decoder have 1024 positions (vllm-omni's own code2wav engine
    # ran at 1024 in deploy/gpu/parity.py); a request's flat codec stream stays well under it.
    # The talkers' step budgets are the same on both servers. vllm-omni's code2wav takes each chunk's
    # codes as Q x frames prompt tokens (ours a placeholder token a chunk), so its budget stays as
    # shipped: a budget sized for ours (1024) holds about two of its chunks a step.
    talker.update(max_model_len=1024, max_num_batched_tokens=4096)
    code2wav.update(max_model_len=1024)
    code2wav["default_sampling_params"]["max_tokens"] = 1024  # as shipped: its max_model_len
    talker["default_sampling_params"] = dict(temperature=0.0, top_k=-1, top_p=1.0, repetition_penalty=1.0,
                                             **exact_frames(model, frames))
    talker["subtalker_sampling_params"] = dict(do_sample=False)
    for connector in deploy["connectors"].values():  # its codes recorded as they pass (codes_probe.py)
        if connector["name"] == "SharedMemoryConnector":
            connector["name"] = RECORDING_CONNECTOR
    out = work / "vllm-omni-qwen3_tts.yaml"
    out.write_text(yaml.safe_dump(deploy, sort_keys=False))
    return out


def ours_pipeline(work: Path, model: Path, frames: int, chunk_frames: int) -> Path:
    """talker -> code2wav for vllm-omni's classes through the shim, on GPU 0, CUDA graphs on."""
    engine = ('max_num_seqs = 64, seed = 0, gpu_memory_utilization = 0.12, dtype = "bfloat16", '
              'trust_remote_code = true')
    kv = {"talker": TALKER_KV_BYTES, "code2wav": CODE2WAV_KV_BYTES}
    text = f"""# written by deploy/gpu/speech_serving.py
served_model_name = "{model}"
max_input_chars = 2000
speech_prompt = "omni_serve.speech.qwen3_tts:Qwen3TTSPrompt"
register = ["worker_shim.omni_models.registration:register_vllm_omni_models"]
sample_rate = {SAMPLE_RATE}

[stages.talker]
model = "{model}"
device = 0
max_tokens = {frames}
engine = {{ {engine}, kv_cache_memory_bytes = {kv["talker"]}, max_model_len = 1024, max_num_batched_tokens = 4096, additional_config = {{ omni_sidecar = {{ subtalker_sampling = {{ do_sample = false }} }} }} }}
sampling = {{ temperature = 0.0, min_tokens = {frames}, stop_token_ids = {json.dumps(exact_frames(model, frames)["stop_token_ids"])} }}
sidecar = {{ hooks = "omni-talker" }}

[stages.code2wav]
model = "{model}"
device = 0
placeholder_token = 1
engine = {{ {engine}, kv_cache_memory_bytes = {kv["code2wav"]}, max_model_len = 1024, max_num_batched_tokens = 1024, hf_overrides = {{ architectures = ["Qwen3TTSCode2Wav"] }} }}
sidecar = {{ hooks = "omni-code2wav", options = {{ chunk_frames = "{chunk_frames}", initial_chunk_frames = "1", left_context = "72", codebook_size = "64" }} }}
"""
    out = work / "ours-qwen3_tts.toml"
    out.write_text(text)
    return out


@dataclass
class ServerProcess:
    name: str
    port: int
    proc: subprocess.Popen
    log: Path

    def tail(self, n: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-n:]



def stop_all(servers: list[ServerProcess]) -> None:
    """SIGINT to each server (it stops its engines: a signal to their processes too would race its
    own shutdown, and an engine core killed mid-teardown leaves its shared-memory queue in
    /dev/shm), then SIGKILL to what is left of each one's process group after STOP_WAIT_S."""
    for server in servers:
        if server.proc.poll() is None:
            server.proc.send_signal(signal.SIGINT)
    deadline = time.monotonic() + STOP_WAIT_S
    for server in servers:
        try:
            server.proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
        while group_alive(server.proc.pid) and time.monotonic() < deadline:  # its engines' own teardown
            time.sleep(0.1)
        try:
            os.killpg(server.proc.pid, signal.SIGKILL)  # what is left of the group, if anything
        except ProcessLookupError:
            pass
        server.proc.wait(10)


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def codes_files(work: Path) -> dict[str, Path]:
    """Where each server's codes go: omni-serve's --codes-log, vllm-omni's probe (codes_probe.py)."""
    return {"ours": work / "ours-codes.jsonl", "vllm-omni": work / "vllm-omni-codes.jsonl"}


def served_codes(work: Path, codebooks: int) -> dict[str, list]:
    """Each server's codes per request so far, in the order its requests began (ours: ended)."""
    files = codes_files(work)
    return {"ours": [c for _, c in read_codes_log(files["ours"])] if files["ours"].exists() else [],
            "vllm-omni": [c for _, c in read_probe(files["vllm-omni"], codebooks)] if files["vllm-omni"].exists() else []}


def launch(name: str, cmd: list[str], log: Path, env: dict[str, str], port: int) -> ServerProcess:
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, env=env, start_new_session=True)
    print(f"{name}: {' '.join(cmd)}", flush=True)
    return ServerProcess(name, port, proc, log)


def start_servers(args, work: Path, start_timeout_s: int) -> dict[str, ServerProcess]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    servers: dict[str, ServerProcess] = {}
    if "vllm-omni" in args.servers:
        port = free_port()
        deploy = vllm_omni_deploy(work, args.model, args.frames)
        cmd = [sys.executable, "-m", "vllm_omni.entrypoints.cli.main", "serve", str(args.model), "--omni",
               "--host", "127.0.0.1", "--port", str(port), "--deploy-config", str(deploy),
               "--stage-init-timeout", str(start_timeout_s)]
        # vllm-omni's own plugins (its entry point) load in its processes: its patches, as it is meant to run.
        own = {k: v for k, v in env.items() if k != "VLLM_PLUGINS"}
        probe = probe_site(work / "codes-probe", codes_files(work)["vllm-omni"])
        probe["PYTHONPATH"] = os.pathsep.join([probe["PYTHONPATH"], env.get("PYTHONPATH", "")])
        servers["vllm-omni"] = launch("vllm-omni", cmd, work / "vllm-omni.log",
                                      {**own, **probe, "VLLM_USE_V2_MODEL_RUNNER": "0"}, port)  # its runners are V1's
    if "ours" in args.servers:
        port = free_port()
        pipeline = args.ours_pipeline or ours_pipeline(work, args.model, args.frames, args.ours_chunk_frames)
        cmd = [sys.executable, "-m", "omni_serve", "--pipeline", str(pipeline), "--host", "127.0.0.1", "--port",
               str(port), "--run-dir", str(work / "ours-run"), "--uvicorn-log-level", "warning",
               "--codes-log", str(codes_files(work)["ours"])]
        extra = {"VLLM_PLUGINS": "omni_sidecar_shim", "VLLM_USE_V2_MODEL_RUNNER": "1"}
        servers["ours"] = launch("ours", cmd, work / "ours.log", {**env, **extra}, port)
    return servers


def last_line(text: str) -> str:
    """The last line of a log tail or traceback (the error itself), without terminal colours."""
    lines = [line for line in re.sub(r"\x1b\[[0-9;]*m", "", text).splitlines() if line.strip()]
    return lines[-1].split(")", 1)[-1].strip() if lines and lines[-1].startswith("(") else (lines[-1] if lines else "")


async def wait_healthy(server: ServerProcess, deadline: float) -> float:
    """Seconds until the server's /health answered 200."""
    t0 = time.monotonic()
    while True:
        if server.proc.poll() is not None:
            raise RuntimeError(f"{server.name} exited with {server.proc.returncode}:\n{server.tail()}")
        try:
            got = await request(server.port, "GET", "/health", None)
            if got.status == 200:
                up_s = round(time.monotonic() - t0, 1)
                print(f"{server.name} up after {up_s} s", flush=True)
                return up_s
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{server.name} not healthy after {time.monotonic() - t0:.0f} s (the run's limit less "
                               f"MEASURE_MIN_S and STOP_RESERVE_S):\n{server.tail()}")
        await asyncio.sleep(1.0)


# ---- the load client: HTTP/1.1 over asyncio streams (no client library needed on the host) ----

@dataclass
class Answer:
    status: int
    body: bytes = b""
    t_first_audio: float | None = None  # seconds from the request's start to its first body bytes (200 only)
    t_total: float = 0.0
    error: str = ""


async def request(port: int, method: str, path: str, payload: dict | None, timeout_s: float = 600.0) -> Answer:
    t0 = time.perf_counter()
    reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), 10)
    try:
        data = json.dumps(payload).encode() if payload is not None else b""
        head = (f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nConnection: close\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n")
        writer.write(head.encode() + data)
        await writer.drain()
        return await asyncio.wait_for(_response(reader, t0), timeout_s)
    finally:
        writer.close()
        try:
            await writer.wait_closed()
        except OSError:
            pass


async def _response(reader: asyncio.StreamReader, t0: float) -> Answer:
    status = int((await reader.readline()).split()[1])
    headers = {}
    while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
        key, _, value = line.decode("latin-1").partition(":")
        headers[key.strip().lower()] = value.strip()
    answer = Answer(status)
    parts: list[bytes] = []

    def got(chunk: bytes) -> None:
        if chunk and answer.t_first_audio is None:
            answer.t_first_audio = time.perf_counter() - t0
        parts.append(chunk)

    if "chunked" in headers.get("transfer-encoding", ""):
        while True:
            size = int((await reader.readline()).split(b";")[0], 16)
            if size == 0:
                await reader.readline()
                break
            got(await reader.readexactly(size))
            await reader.readline()
    elif "content-length" in headers:
        got(await reader.readexactly(int(headers["content-length"])))
    else:
        while chunk := await reader.read(1 << 16):
            got(chunk)
    answer.body = b"".join(parts)
    answer.t_total = time.perf_counter() - t0
    if status != 200:
        answer.error = answer.body[:300].decode(errors="replace")
        answer.t_first_audio = None
    return answer


def references() -> dict[str, dict]:
    """Two reference clips and their transcripts (--clone), as request fields."""
    import base64
    import io
    import wave

    import numpy as np

    out = {}
    for seed, name in enumerate(("ref-a", "ref-b")):
        noise = np.random.default_rng(seed).uniform(-0.5, 0.5, int(REFERENCE_SECONDS * SAMPLE_RATE))
        clip = io.BytesIO()
        with wave.open(clip, "wb") as w:
            w.setnchannels(1)
            w.setsampwidth(2)
            w.setframerate(SAMPLE_RATE)
            w.writeframes((noise * 32767).astype("<i2").tobytes())
        out[name] = {"task_type": "Base", "ref_text": f"The reference clip number {seed + 1}.",
                     "ref_audio": "data:audio/wav;base64," + base64.b64encode(clip.getvalue()).decode()}
    return out


def speech_body(text: str, voice: str, frames: int, stream: bool) -> dict:
    body = {"input": text, "response_format": "pcm", "max_new_tokens": frames}
    body.update(REFERENCES[voice] if voice in REFERENCES else {"voice": voice})
    if stream:
        body.update(stream=True, stream_format="audio")
    return body


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


@dataclass
class Round:
    """One round of streaming requests at one concurrency: what each answered request measured."""
    requests: int
    wall_s: float
    ttfa_ms: list[float]  # POST to the first audio bytes, per answered request
    audio_s: list[float]  # its audio's length
    total_s: list[float]  # POST to its last byte
    errors: list[str]


async def one_round(port: int, concurrency: int, total: int, frames: int, rate: int, deadline: float,
                    voices: tuple[str, ...] = tuple(VOICES)) -> Round:
    """`total` streaming requests, `concurrency` at a time (the texts and voices in turn), none past the deadline."""
    gate = asyncio.Semaphore(concurrency)

    async def one(i: int) -> Answer:
        async with gate:
            return await request(port, "POST", "/v1/audio/speech",
                                 speech_body(TEXTS[i % len(TEXTS)], voices[i % len(voices)], frames, True),
                                 timeout_s=max(1.0, deadline - time.monotonic()))

    t0 = time.perf_counter()
    answers = await asyncio.gather(*(one(i) for i in range(total)), return_exceptions=True)
    wall = time.perf_counter() - t0
    ok = [a for a in answers if isinstance(a, Answer) and a.status == 200 and a.body]
    errors = [a.error if isinstance(a, Answer) else f"{type(a).__name__}: {a}" for a in answers
              if not (isinstance(a, Answer) and a.status == 200 and a.body)]
    return Round(total, wall, [a.t_first_audio * 1000 for a in ok], [len(a.body) / 2 / rate for a in ok],
                 [a.t_total for a in ok], errors)


def round_ttfa_ms(r: Round, q: float) -> float:
    return percentile(r.ttfa_ms, q)


def round_audio_s_per_s(r: Round) -> float:
    return sum(r.audio_s) / r.wall_s


def spread(values: list[float], digits: int = 2) -> dict:
    """Per-round values: their median, min..max and bootstrap 95 % interval of the median."""
    lo, hi = bootstrap_median(values)
    return {"rounds": len(values), "median": round(statistics.median(values), digits), "min": round(min(values), digits),
            "max": round(max(values), digits), "ci95": [round(lo, digits), round(hi, digits)]}


def figures(rounds: list[Round]) -> dict:
    """A server's figures at one level over its timed rounds: TTFA p50/p95 over all their requests, audio
    seconds per second (their audio over their wall time) and RTF (median of each request's time over its
    audio's length), with each figure's spread over the rounds."""
    ttfa = [t for r in rounds for t in r.ttfa_ms]
    audio = [a for r in rounds for a in r.audio_s]
    wall = sum(r.wall_s for r in rounds)
    out: dict = {"rounds": len(rounds), "requests": sum(r.requests for r in rounds), "ok": len(ttfa),
                 "wall_s": round(wall, 3)}
    if ttfa:
        answered = [r for r in rounds if r.ttfa_ms]
        out.update(ttfa_ms_p50=round(percentile(ttfa, 50), 2), ttfa_ms_p95=round(percentile(ttfa, 95), 2),
                   audio_s_per_s=round(sum(audio) / wall, 3),
                   rtf=round(statistics.median(t / a for r in rounds for t, a in zip(r.total_s, r.audio_s)), 4),
                   audio_s_per_request=round(statistics.median(audio), 3),
                   spread={"ttfa_ms_p50": spread([round_ttfa_ms(r, 50) for r in answered]),
                           "ttfa_ms_p95": spread([round_ttfa_ms(r, 95) for r in answered]),
                           "audio_s_per_s": spread([round_audio_s_per_s(r) for r in answered], 3)})
    errors = [e for r in rounds for e in r.errors]
    if errors:
        out["errors"] = errors[:3]
    return out


def block_ratios(blocks: list[dict[str, list[Round]]], num: str, den: str) -> dict:
    """Per complete block (each server's two rounds): `num`'s mean round TTFA p95 over `den`'s (below 1:
    `num` answers sooner) and its mean audio seconds per second over `den`'s (above 1: `num` serves more);
    the median of the blocks' ratios with a bootstrap 95 % interval. A machine's drift over a block hits both
    servers alike (bench/ab_stats.py's ABBA / BAAB)."""
    out = {}
    for key, of in (("ttfa_ms_p95", lambda r: round_ttfa_ms(r, 95)), ("audio_s_per_s", round_audio_s_per_s)):
        ratios = [statistics.fmean(map(of, b[num])) / statistics.fmean(map(of, b[den])) for b in blocks
                  if all(len(b.get(n, [])) == 2 and all(r.ttfa_ms for r in b[n]) for n in (num, den))]
        if ratios:
            lo, hi = bootstrap_median(ratios)
            out[f"{key}_ratio"] = {"blocks": len(ratios), "median": round(statistics.median(ratios), 3),
                                   "ci95": [round(lo, 3), round(hi, 3)]}
    return out


SHARE_METRIC = "omni_serve_stage_first_audio_seconds"  # omni-serve's /metrics: each stage's share of TTFA
SHARE_LINE = re.compile(SHARE_METRIC + r'_(sum|count)\{stage="([^"]+)"\} ([0-9.eE+-]+)')


def first_audio_shares(metrics_text: str) -> dict[str, tuple[float, float]]:
    """Per stage, (sum of seconds, count) of omni-serve's first-audio share histogram."""
    got: dict[str, list[float]] = {}
    for kind, stage, value in SHARE_LINE.findall(metrics_text):
        got.setdefault(stage, [0.0, 0.0])[0 if kind == "sum" else 1] = float(value)
    return {stage: (total, count) for stage, (total, count) in got.items()}


def shares_between(before: dict[str, tuple[float, float]], after: dict[str, tuple[float, float]]) -> dict[str, float]:
    """Each stage's mean share (ms) of the requests between two scrapes."""
    out = {}
    for stage, (total, count) in after.items():
        total0, count0 = before.get(stage, (0.0, 0.0))
        if count > count0:
            out[stage] = round((total - total0) / (count - count0) * 1000, 2)
    return out


async def scrape_shares(server: "ServerProcess") -> dict[str, tuple[float, float]]:
    if server.name != "ours":  # vllm-omni's server logs its own per-stage table (its log tail)
        return {}
    try:
        got = await request(server.port, "GET", "/metrics", None, timeout_s=10)
    except (OSError, TimeoutError, ValueError, IndexError) as exc:  # the shares are extra: the level's figures stand
        print(f"{server.name}: /metrics not read ({type(exc).__name__}: {exc}); no first-audio shares", flush=True)
        return {}
    return first_audio_shares(got.body.decode("utf-8", "replace")) if got.status == 200 else {}


async def compare_waveforms(servers: dict[str, ServerProcess], frames: int, deadline: float, voices: list[str],
                            codes: Callable[[], dict[str, list]] | None = None) -> dict:
    """The same non-streaming requests to both, one at a time, each asked of each server twice (so a
    difference between the servers can be told from one server disagreeing with itself); samples
    compared, and with `codes` (each server's codes per request so far, in order) the codes.
    `per_request`: each one's lengths (samples), largest differences, whether its codes are equal."""
    import numpy as np

    codes_before = {name: len(got) for name, got in codes().items()} if codes is not None else {}

    def max_diff(a: np.ndarray, b: np.ndarray) -> float:
        n = min(a.size, b.size)
        return float(np.abs(a[:n] - b[:n]).max()) if n else 0.0

    diffs, equal_len, peaks, failures, per_request = [], 0, [], [], []
    pairs = [(text, voice) for text in TEXTS for voice in voices]
    for text, voice in pairs:
        waves: dict[str, list[np.ndarray]] = {}
        for name in ("vllm-omni", "ours", "vllm-omni", "ours"):
            got = await request(servers[name].port, "POST", "/v1/audio/speech", speech_body(text, voice, frames, False),
                                timeout_s=max(1.0, deadline - time.monotonic()))
            if got.status != 200:
                failures.append(f"{name}: {got.status} {got.error}")
                break
            waves.setdefault(name, []).append(np.frombuffer(got.body, "<i2").astype(np.float64) / 32768.0)
        if len(waves) < 2:
            continue
        (a, *a2), (b, *b2) = waves["vllm-omni"], waves["ours"]
        equal_len += int(a.shape == b.shape)
        diffs.append(max_diff(a, b))
        peaks.append(float(np.abs(a).max()) if a.size else 0.0)
        per_request.append({"voice": voice, "samples": {"vllm-omni": [w.size for w in waves["vllm-omni"]],
                                                        "ours": [w.size for w in waves["ours"]]},
                            "max_abs_diff": round(diffs[-1], 6),
                            # the second asks of each against each other: where a server disagreed with itself
                            "second_asks_max_abs_diff": round(max_diff(a2[0], b2[0]), 6) if a2 and b2 else None,
                            "self_max_abs_diff": {"vllm-omni": round(max_diff(a, a2[0]), 6) if a2 else None,
                                                  "ours": round(max_diff(b, b2[0]), 6) if b2 else None}})
    out = {"requests": len(pairs), "compared": len(diffs), "same_length": f"{equal_len}/{len(pairs)}",
           "waveform_max_abs_diff": max(diffs) if diffs else None,
           "tolerance": round(WAVEFORM_RTOL * max(peaks), 6) if peaks else None}
    out["within_tolerance"] = (f"{sum(d <= WAVEFORM_RTOL * max(peaks) for d in diffs)}/{len(pairs)}"
                               if peaks else f"0/{len(pairs)}")
    out["per_request"] = per_request
    if failures:
        out["failures"] = failures[:4]
    if codes is not None and not failures:
        out.update(compare_codes({name: got[codes_before[name]:] for name, got in codes().items()}, per_request))
    return out


def compare_codes(served: dict[str, list], per_request: list[dict]) -> dict:
    """Each server's codes of the compared requests (two asks each, in order) side by side: the first
    asks counted in `codes_identical`, each request's both asks in its `per_request` entry."""
    import numpy as np

    n = len(per_request)
    got = {name: served.get(name, []) for name in ("vllm-omni", "ours")}
    if any(len(c) != 2 * n for c in got.values()):
        return {"codes_identical": None, "codes_note": "codes of " + ", ".join(
            f"{name} {len(c)}" for name, c in got.items()) + f" requests, not the {2 * n} asked"}
    same = 0
    for i, entry in enumerate(per_request):
        asks = [bool(np.array_equal(got["vllm-omni"][2 * i + k], got["ours"][2 * i + k])) for k in (0, 1)]
        entry["codes_identical"] = asks
        entry["frames"] = {name: [int(c.shape[0]) for c in got[name][2 * i:2 * i + 2]] for name in got}
        same += asks[0]
    return {"codes_identical": f"{same}/{n}"}


# ---- the run ----

def table(results: dict) -> str:
    rows = ["| server | concurrency | TTFA p50 ms | TTFA p95 ms (rounds' min..max) | audio s/s (rounds' min..max) "
            "| RTF | rounds | ok/requests | first audio by stage (mean ms) |",
            "|---|---|---|---|---|---|---|---|---|"]

    def ranged(got: dict, key: str) -> str:
        if key not in got:
            return "-"
        r = got["spread"][key]
        return f"{got[key]} ({r['min']}..{r['max']})"

    for name in SERVERS:
        for c, got in results.get(name, {}).items():
            shares = ", ".join(f"{stage} {ms}" for stage, ms in got.get("first_audio_share_ms", {}).items()) or "-"
            rows.append(f"| {name} | {c} | {got.get('ttfa_ms_p50', '-')} | {ranged(got, 'ttfa_ms_p95')} | "
                        f"{ranged(got, 'audio_s_per_s')} | {got.get('rtf', '-')} | {got['rounds']} | "
                        f"{got['ok']}/{got['requests']} | {shares} |")
    return "\n".join(rows)


async def measure_level(servers: dict[str, ServerProcess], index: int, c: int, args, deadline: float,
                        levels_left: int, results: dict) -> bool:
    """One level: an untimed warm-up round per server at this concurrency (what a server does the first time
    at a batch size stays out of the figures), then timed blocks, each server's rounds in ABBA, then BAAB
    order, while the level's share of the time left lasts (at most --max-blocks). False: not one block fit."""
    names = list(servers)
    size = max(2 * c, 8)  # requests a round

    def round_of(name: str):
        return one_round(servers[name].port, c, size, args.frames, args.sample_rate, deadline, tuple(args.voices))

    warm = {}
    for name in block_order(index, names)[:len(names)]:
        warm[name] = await round_of(name)
    block_s = 2 * sum(r.wall_s for r in warm.values())  # a block's length, until one has run
    level_end = time.monotonic() + (deadline - time.monotonic()) / levels_left
    before = {name: await scrape_shares(server) for name, server in servers.items()}
    blocks: list[dict[str, list[Round]]] = []
    while len(blocks) < args.max_blocks and time.monotonic() + block_s <= (level_end if blocks else deadline):
        t0 = time.monotonic()
        block: dict[str, list[Round]] = {}
        for name in block_order(index + len(blocks), names):
            block.setdefault(name, []).append(await round_of(name))
        blocks.append(block)
        block_s = time.monotonic() - t0
    if not blocks:
        results["notes"].append(f"stopped at the limit: no timed block at concurrency {c} fits")
        return False
    for name in names:
        got = figures([r for block in blocks for r in block[name]])
        got["warm_up"] = {"wall_s": round(warm[name].wall_s, 3), "ok": len(warm[name].ttfa_ms)}
        shares = shares_between(before[name], await scrape_shares(servers[name]))
        if shares:  # where a request's first audio went, stage by stage (means over the timed rounds, ms)
            got["first_audio_share_ms"] = shares
        results[name][str(c)] = got
        print(f"{name} @ {c}: {json.dumps(got)}", flush=True)
    if set(names) == set(SERVERS):
        results["ours_over_vllm_omni"][str(c)] = block_ratios(blocks, "ours", "vllm-omni")
    return True


async def run(args) -> dict:
    t_start = time.monotonic()
    deadline = t_start + args.limit_s - STOP_RESERVE_S
    work = args.work
    work.mkdir(parents=True, exist_ok=True)
    if args.clone:
        REFERENCES.update(references())
        args.voices = list(REFERENCES)
    elif args.model is not None:
        with_speakers(args.model)
    results: dict = {"servers": list(args.servers), "levels": list(args.levels), "frames_per_request": args.frames,
                     "codes_identical": None, "codes_note": "not compared: both servers answer the same requests first",
                     "waveform_max_abs_diff": None, "complete": False, "notes": []}
    for name in args.servers:
        results[name] = {}
    if "vllm-omni" in args.servers and importlib.util.find_spec("vllm_omni") is None:  # ours still runs
        results["notes"].append("vllm-omni did not start: it is not installed (a bundle without BUNDLE_OMNI)")
        args.servers = [name for name in args.servers if name != "vllm-omni"]
    start_deadline = deadline - MEASURE_MIN_S
    start_timeout_s = int(start_deadline - time.monotonic())
    servers = start_servers(args, work, start_timeout_s)
    results["start_timeout_s"] = start_timeout_s
    from parity import run_commit, run_versions  # deploy/gpu/ is this script's folder

    results["versions"], results["commit"] = run_versions(), run_commit()
    try:
        started = await asyncio.gather(*(wait_healthy(s, start_deadline) for s in servers.values()),
                                       return_exceptions=True)
        for (name, server), outcome in zip(list(servers.items()), started):
            if isinstance(outcome, BaseException):  # the other server still runs: its figures stand alone
                why = str(outcome).split("\n", 1)[0].removesuffix(":")  # how long it waited, or how it exited
                results["notes"].append(f"{name} did not start: {type(outcome).__name__}: {why}; its log's last line: "
                                        f"{last_line(str(outcome))}")
                stop_all([server])
                del servers[name]
            else:
                results.setdefault("up_s", {})[name] = outcome
        if not servers:
            return results
        results["start_s"] = round(time.monotonic() - t_start, 1)
        print(f"servers up after {results['start_s']} s", flush=True)
        for server in servers.values():  # warm-up: first requests compile, capture, load tokenizers
            for voice in args.voices:
                try:
                    await request(server.port, "POST", "/v1/audio/speech",
                                  speech_body(TEXTS[0], voice, args.frames, True),
                                  timeout_s=max(1.0, deadline - time.monotonic()))
                except asyncio.TimeoutError:
                    raise TimeoutError(f"{server.name}'s warm-up request ({voice}) not answered by the run's limit "
                                       f"({time.monotonic() - t_start:.0f} s in)") from None
        if len(servers) == 2:
            codebooks = codec_codebooks(args.model) if args.model is not None else None
            compared = await compare_waveforms(servers, args.frames, deadline, args.voices,
                                               (lambda: served_codes(work, codebooks)) if codebooks else None)
            results["waveform"] = compared
            results["waveform_max_abs_diff"] = compared["waveform_max_abs_diff"]
            if compared.get("codes_identical") is not None:
                results["codes_identical"], results["codes_note"] = compared["codes_identical"], CODES_NOTE
            elif "codes_note" in compared:
                results["codes_note"] = compared["codes_note"]
            print(f"waveforms: {json.dumps(compared)}", flush=True)
            results["ours_over_vllm_omni"] = {}
        for i, c in enumerate(args.levels):
            if not await measure_level(servers, i, c, args, deadline, len(args.levels) - i, results):
                return results
        results["complete"] = True
        return results
    except (RuntimeError, TimeoutError, OSError, asyncio.TimeoutError) as exc:
        results["notes"].append(f"{type(exc).__name__}: {exc}"[:4000])
        return results
    except asyncio.CancelledError:  # SIGTERM (the shell's timeout): what there is, servers stopped
        results["notes"].append("stopped by SIGTERM")
        return results
    finally:
        stop_all(list(servers.values()))
        results["elapsed_s"] = round(time.monotonic() - t_start, 1)


def benchmarks_rows(results: dict) -> str:
    lines = [table(results), "",
             f"Waveforms (same requests, non-streaming): max abs diff {results.get('waveform_max_abs_diff')} "
             f"({json.dumps(results.get('waveform', {}))}); codes: {results['codes_note']}."]
    for c, ratios in results.get("ours_over_vllm_omni", {}).items():
        lines.append(f"Ours over vllm-omni at {c}, per ABBA block (median, 95 % interval): " + "; ".join(
            f"{key.removesuffix('_ratio')} {r['median']} {r['ci95']} ({r['blocks']} blocks)" for key, r in ratios.items()))
    return "\n".join(lines)


async def main_task(args) -> dict:
    """run(), cancelled by SIGTERM (so its servers are stopped and its results kept)."""
    task = asyncio.current_task()
    assert task is not None
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)
    return await run(args)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=None, help="the tiny Qwen3-TTS checkpoint (not with --ours-pipeline)")
    p.add_argument("--work", type=Path, required=True)
    p.add_argument("--result", type=Path, required=True)
    p.add_argument("--limit-s", type=float, default=440)
    p.add_argument("--servers", default=",".join(SERVERS))
    p.add_argument("--levels", default=",".join(map(str, LEVELS)))
    p.add_argument("--frames", type=int, default=48, help="codec frames per request (12.5 a second of audio)")
    p.add_argument("--ours-pipeline", type=Path, default=None)
    p.add_argument("--ours-chunk-frames", type=int, default=25,
                   help="omni-serve's code2wav chunk (vllm-omni's steady chunk: 25; its first is 1 frame)")
    p.add_argument("--max-blocks", type=int, default=MAX_BLOCKS,
                   help="timed blocks per level at most (a block: each server's round twice, ABBA / BAAB)")
    p.add_argument("--sample-rate", type=int, default=SAMPLE_RATE, help="the servers' pcm rate (the CPU check's: 300)")
    p.add_argument("--clone", action="store_true",
                   help="the model is a Base checkpoint: requests clone the voices of two reference clips")
    p.add_argument("--voices", default=",".join(VOICES),
                   help="the voices requests name, in turn (with --ours-pipeline: that config's)")
    args = p.parse_args()
    args.servers = [s for s in args.servers.split(",") if s]
    assert set(args.servers) <= set(SERVERS), args.servers
    args.levels = [int(c) for c in args.levels.split(",")]
    args.voices = [v for v in args.voices.split(",") if v]
    assert (args.model is None) == (args.ours_pipeline is not None), "--model, or --ours-pipeline and no vllm-omni"
    assert args.ours_pipeline is None or args.servers == ["ours"], "--ours-pipeline serves ours alone"
    if args.model is not None:
        args.model = args.model.resolve()
    results = asyncio.run(main_task(args))
    args.result.parent.mkdir(parents=True, exist_ok=True)
    args.result.write_text(json.dumps(results, indent=1) + "\n")
    rows = benchmarks_rows(results)
    args.result.with_name(f"{args.result.stem}-rows.md").write_text(rows + "\n")
    print(rows)
    for note in results["notes"]:
        print("note:", note)
    return 0 if results["complete"] else 1


if __name__ == "__main__":
    sys.exit(main())
