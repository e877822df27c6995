"""One engine serving vllm-omni's own Qwen3-TTS talker class, in a process of its own.

  python deploy/gpu/talker_engines.py job.json result.json     (job["kind"]: omni or shim)

`omni`: vllm-omni 0.26's own way of running a talker stage: its engine arguments
(`OmniEngineArgs`: AR worker `GPUARWorker` -> its `GPUARModelRunner` on vLLM's V1
runner, its `OmniARScheduler`, its `subtalker_sampling_params`) and its request
builder (`build_engine_core_request_from_tokens`, its payload serializer). The codes
it produces are read from its engine-core outputs (`multimodal_output`).

`shim`: upstream vLLM V2 with the shim as worker (vllm-omni's class loaded without its
patches: worker_shim/omni_models/) and an `omni-sidecar serve --hooks omni-talker` at
`job["endpoint"]`; the payload goes in `extra_args` encoded by us, the codes come back from
the sidecar (`codes.audio`). Each engine reports the vllm-omni patches found in its processes.

Both: the same model directory, requests, greedy sampling (code 0 by vLLM's sampler,
codes 1..Q-1 by the model's code predictor with do_sample=False; the bench's sampled
sets sample code 0), CUDA graphs on, each step timed around `LLMEngine.step()`.
A bench set's decode step, per request: the time from the step that brought the set's last
first token (every prefill done) to the request's last token, over the tokens it got
meanwhile (a step may bring no tokens, or some requests' only: async scheduling, an engine
splitting its batch). The engines' timed rounds alternate in a fixed order (Turns).
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # engine core in this process: its outputs are readable
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

GREEDY_SUBTALKER = {"do_sample": False}


def talker_requests(specs: list[dict], prefix: str) -> list[dict]:
    """Qwen3-TTS VoiceDesign requests with their text ids precomputed (no tokenizer involved).

    Text ids follow the assistant template the prompt builder slices: 3 role ids, the
    text, 5 closing ids. Prompt rows: 3 role + 4 codec prefix, then (non-streaming) the
    text + tts_eos + 1, or (streaming) 1 first text row, the rest fed one per decode step.
    """
    import numpy as np
    import torch

    from tests.tiny_models.qwen3_tts import IM_END, IM_START, TEXT_VOCAB

    out = []
    for i, spec in enumerate(specs):
        rng = np.random.default_rng(spec["seed"])
        text = rng.integers(0, TEXT_VOCAB - 8, spec["text_len"]).tolist()
        ids = [IM_START, 1, 2] + text + [IM_END, 3, IM_START, 1, 2]
        streaming = bool(spec["streaming"])
        prompt_len = 8 if streaming else 9 + spec["text_len"]
        info = {"_qwen3_tts_text_ids": torch.tensor([ids], dtype=torch.long), "task_type": ["VoiceDesign"],
                "non_streaming_mode": [not streaming]}
        out.append({"rid": f"{prefix}{i}", "prompt_token_ids": [5] * prompt_len, "info": info,
                    "max_tokens": spec["max_tokens"], "stop_token_ids": spec.get("stop_token_ids")})
    return out


def common_engine_args(job: dict) -> dict:
    args = dict(model=job["model"], dtype="bfloat16", seed=0, enforce_eager=False, skip_tokenizer_init=True,
                enable_prefix_caching=False, async_scheduling=False, max_model_len=512,
                max_num_seqs=job["max_num_seqs"], max_num_batched_tokens=job["max_num_batched_tokens"],
                kv_cache_memory_bytes=1 << 30,
                gpu_memory_utilization=job.get("gpu_memory_utilization", 0.4))  # engines side by side on one GPU
    args.update(job.get("engine_overrides", {}))
    return args


def omni_engine(job: dict) -> tuple[Any, Any]:
    from vllm.v1.engine.llm_engine import LLMEngine
    from vllm_omni.engine.arg_utils import OmniEngineArgs
    from vllm_omni.engine.orchestrator import build_engine_core_request_from_tokens

    args = OmniEngineArgs(**common_engine_args(job), stage_id=0, model_stage="qwen3_tts",
                          model_arch="Qwen3TTSTalkerForConditionalGeneration", worker_type="ar",
                          engine_output_type="latent", subtalker_sampling_params=GREEDY_SUBTALKER,
                          scheduler_cls="vllm_omni.core.sched.omni_ar_scheduler.OmniARScheduler")
    engine = LLMEngine.from_engine_args(args)

    def add(req: dict, params: Any) -> None:
        ecr = build_engine_core_request_from_tokens(
            req["rid"], {"prompt_token_ids": req["prompt_token_ids"], "additional_information": req["info"]}, params)
        engine.add_request(req["rid"], ecr, params)

    return engine, add


def shim_engine(job: dict) -> tuple[Any, Any]:
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.engine.llm_engine import LLMEngine

    from omni_sidecar.hook_sets.omni.wire import encode_additional_information

    args = EngineArgs(**common_engine_args(job), worker_cls="worker_shim.Worker",
                      additional_config={"omni_sidecar": {"endpoint": job["endpoint"],
                                                          "subtalker_sampling": GREEDY_SUBTALKER,
                                                          **job.get("shim_settings", {})}})
    engine = LLMEngine.from_engine_args(args)

    def add(req: dict, params: Any) -> None:
        params = params.clone()
        params.extra_args = {"omni_sidecar": {"additional_information": encode_additional_information(req["info"])}}
        engine.add_request(req["rid"], {"prompt_token_ids": req["prompt_token_ids"]}, params)

    return engine, add


class OutputRecorder:
    """The engine core's outputs per request, in order (vllm-omni's codes ride `multimodal_output`)."""

    def __init__(self, engine: Any) -> None:
        self.by_request: dict[str, list[dict]] = {}
        self.active = True  # off for the timed rounds: reading the outputs costs host time and a sync
        core = engine.engine_core
        inner = core.get_output

        def get_output() -> Any:
            outs = inner()
            for o in (getattr(outs, "outputs", []) or []) if self.active else ():
                mm = getattr(o, "multimodal_output", None)
                external = o.request_id.rsplit("-", 1)[0]  # vLLM suffixes the client's id
                self.by_request.setdefault(external, []).append(
                    {"new": list(o.new_token_ids or []), "mm": _plain(mm) if mm else None,
                     "finished": getattr(o, "finish_reason", None) is not None})
            return outs

        core.get_output = get_output


def _plain(obj: Any) -> Any:
    import torch

    if isinstance(obj, torch.Tensor):
        return {"shape": list(obj.shape), "values": obj.detach().cpu().tolist()}
    if isinstance(obj, dict):
        return {str(k): _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    return obj if isinstance(obj, (int, float, str, bool)) or obj is None else repr(obj)


def omni_codes(records: list[dict]) -> list[list[int]] | None:
    """codes.audio rows of the decode steps: the outputs after the one that ended the prefill."""
    rows: list[list[int]] = []
    seen_token = False
    for rec in records:
        mm = rec["mm"] or {}
        audio = mm.get("codes.audio") or (mm.get("codes") or {}).get("audio")
        if seen_token and isinstance(audio, dict):
            rows.extend(audio["values"])
        seen_token = seen_token or bool(rec["new"])
    return rows or None


def drive(engine: Any, add: Any, reqs: list[dict], temperature: float = 0.0) -> dict:
    """All requests added, then `engine.step()` until done; each step timed, and each request's
    decode step (module docstring)."""
    from vllm import SamplingParams

    for i, req in enumerate(reqs):
        sampling = dict(temperature=temperature, top_k=50, seed=1000 + i) if temperature > 0 else dict(temperature=0.0)
        add(req, SamplingParams(max_tokens=req["max_tokens"], ignore_eos=True, detokenize=False,
                                stop_token_ids=req.get("stop_token_ids"), **sampling))
    tokens: dict[str, list[int]] = {}
    counts: dict[str, int] = {}
    last: dict[str, tuple[float, int]] = {}  # per request: when its count last grew, and to what
    start: tuple[float, dict[str, int]] | None = None  # when every request had its first token, their counts
    step_s: list[float] = []
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        outs = engine.step()
        t1 = time.perf_counter()
        step_s.append(t1 - t0)
        for o in outs:
            n = len(o.outputs[0].token_ids)
            if n > counts.get(o.request_id, 0):
                last[o.request_id] = (t1, n)
            counts[o.request_id] = n
            if o.finished:
                tokens[o.request_id] = list(o.outputs[0].token_ids)
        if start is None and len(counts) == len(reqs):
            start = (t1, dict(counts))
    decode_s = []
    if start is not None:
        t_all, base = start
        for req_id, (t, n) in last.items():
            if n > base.get(req_id, n) and t > t_all:
                decode_s.append((t - t_all) / (n - base[req_id]))
    return {"tokens": [tokens.get(r["rid"]) for r in reqs], "step_s": step_s, "decode_s": decode_s}


def mark_ready(job: dict) -> None:
    Path(job["workdir"], f"ready-{job['name']}").touch()


def bench_ready(job: dict) -> None:
    """Engines start side by side (start-up is most of the wall time) but time their bench
    rounds one at a time: wait until every engine of the run has done its untimed work (or gave up)."""
    mark_ready(job)
    work = Path(job["workdir"])
    deadline = time.monotonic() + job.get("barrier_s", 300)
    while time.monotonic() < deadline and not all((work / f"ready-{k}").exists() for k in job["barrier"]):
        time.sleep(0.2)


TURN_WAIT_S = 30  # a round takes a second or two: an engine this late is stuck or gone


class Turns:
    """The timed rounds of all bench engines in one fixed order: round by round, in each round every
    bench set, each engine in turn, the engines' order reversed every other round (ABBA), so that the
    engines compared alternate and a deadline cuts the last rounds of every set alike; after the
    last round, the untimed profile pass of each engine in `job["profiled"]` on the profiled set. A
    file holds the index of the turn now; an engine that is gone (`gone-NAME`) loses its turns; a
    wait longer than `turn_wait_s` runs the round anyway (a slow engine may then overlap another's)."""

    def __init__(self, job: dict) -> None:
        self.job = job
        self.work = Path(job["workdir"])
        engines = list(job["engines"])
        sets = job["bench_sets"]
        self.order = []
        for r in range(max((s.get("rounds", 1) for s in sets), default=0)):
            for s in sets:
                if r < s.get("rounds", 1):
                    self.order += [f"{e}|{s['name']}|{r}" for e in (engines if r % 2 == 0 else engines[::-1])]
        profile_set = (job.get("profile") or {}).get("set")
        if any(s["name"] == profile_set for s in sets):
            self.order += [f"{e}|{profile_set}|profile" for e in job.get("profiled", [])]
        self.wait_s = job.get("turn_wait_s", TURN_WAIT_S)

    def _index(self) -> int:
        try:
            return int((self.work / "turn").read_text() or 0)
        except (OSError, ValueError):
            return 0

    def _advance(self, to: int) -> None:
        import fcntl

        with open(self.work / "turn.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if to > self._index():
                tmp = self.work / f"turn.{os.getpid()}"
                tmp.write_text(str(to))
                os.replace(tmp, self.work / "turn")

    def wait(self, key: str) -> float:
        """Until `key`'s turn (or `wait_s`); returns the seconds waited."""
        t0 = time.monotonic()
        while time.monotonic() < t0 + self.wait_s:
            i = self._index()
            if i >= len(self.order) or self.order[i] == key or key not in self.order[i:]:
                break
            if (self.work / f"gone-{self.order[i].split('|')[0]}").exists():
                self._advance(i + 1)
                continue
            time.sleep(0.002)
        return time.monotonic() - t0

    def done(self, key: str) -> None:
        if key in self.order:
            self._advance(self.order.index(key) + 1)

    def leave(self, engine: str) -> None:
        """`engine` takes no more turns (gone, or past the run's deadline): the others skip them."""
        (self.work / f"gone-{engine}").touch()

    def take(self, key: str) -> float | None:
        """`wait` for `key`'s turn, unless the run's deadline passed (before or while waiting): then no
        round starts, this engine leaves the turns and None comes back; else the seconds waited."""
        waited = 0.0 if past_deadline(self.job) else self.wait(key)
        if past_deadline(self.job):
            self.leave(key.split("|")[0])
            return None
        return waited


def start_profile(job: dict) -> Any:
    """py-spy on this process (and on its sidecar, `sidecar_pid`) for `profile["seconds"]` (whole
    seconds: py-spy refuses a fraction), when py-spy is on PATH; returns the engine's sampler."""
    import math
    import shutil
    import subprocess

    prof = job.get("profile") or {}
    exe = shutil.which("py-spy")
    if not prof or exe is None:
        return None
    procs = []
    for pid, name in ((os.getpid(), job["name"]), (job.get("sidecar_pid"), f"{job['name']}-sidecar")):
        if not pid:
            continue
        out = Path(job["workdir"]) / f"{name}.pyspy.txt"
        with open(out.with_suffix(".log"), "w") as log:  # a refused ptrace says so there
            procs.append(subprocess.Popen([exe, "record", "--pid", str(pid), "--rate", str(prof.get("rate", 400)),
                                           "--duration", str(math.ceil(prof["seconds"])), "--format", "raw",
                                           "--nonblocking",
                                           "--output", str(out)], stdout=log, stderr=subprocess.STDOUT))
    return procs[0]


def past_deadline(job: dict) -> bool:
    """No more timed rounds: the run's time is nearly up (its report must still be written)."""
    return "deadline_unix" in job and time.time() > job["deadline_unix"]


WARM_SET_TOKENS = 4  # enough for every request of a set to decode together


def warm_bench_sets(engine: Any, add: Any, job: dict) -> None:
    """Each bench set once, untimed and short, before the barrier (engines side by side): what a set
    meets first (its batch sizes' graphs, the sampler's kernels) is compiled outside the timed rounds."""
    for spec in job["bench_sets"]:
        reqs = [{**r, "max_tokens": WARM_SET_TOKENS} for r in spec["reqs"]]
        drive(engine, add, talker_requests(reqs, f"{spec['name']}-warm-"), spec.get("temperature", 0.0))


def bench(engine: Any, add: Any, job: dict) -> tuple[dict, int]:
    """The timed rounds in their turns (Turns: round by round, every set in each), then, for an engine
    in `job["profiled"]`, py-spy over repeats of the profiled set in a turn of its own (the timed rounds
    unperturbed). Past the run's deadline no round starts; returns each set's rounds and how many were
    cut."""
    results: dict = {s["name"]: [] for s in job["bench_sets"]}
    cut = 0
    prof = job.get("profile") or {}
    turns = Turns(job)
    for r in range(max((s.get("rounds", 1) for s in job["bench_sets"]), default=0)):
        for spec in job["bench_sets"]:
            if r >= spec.get("rounds", 1):
                continue
            key = f"{job['name']}|{spec['name']}|{r}"
            waited = turns.take(key)
            if waited is None:  # past the deadline: the others are too, or skip our turns
                cut += 1
                continue
            reqs = talker_requests(spec["reqs"], f"{spec['name']}-{r}-")
            try:
                start_unix = time.time()
                run = drive(engine, add, reqs, spec.get("temperature", 0.0))
            finally:
                turns.done(key)
            results[spec["name"]].append({"decode_s": run["decode_s"], "steps": len(run["step_s"]),
                                          "wall_s": sum(run["step_s"]), "start_unix": start_unix,
                                          "turn_wait_s": waited})
    spec = next((s for s in job["bench_sets"] if s["name"] == prof.get("set")), None)
    if spec is not None and job["name"] in job.get("profiled", []) and not past_deadline(job):
        key = f"{job['name']}|{spec['name']}|profile"
        turns.wait(key)
        try:
            profiler = start_profile(job)
            k = 0
            while profiler is not None and profiler.poll() is None:  # repeats of the set until py-spy is done
                drive(engine, add, talker_requests(spec["reqs"], f"{spec['name']}-p{k}-"), spec.get("temperature", 0.0))
                k += 1
        finally:
            turns.done(key)
    return results, cut


def load_job(job_path: str) -> tuple[dict, dict]:
    """The job, with its environment applied (before vLLM is imported), and the result it starts."""
    job = json.loads(Path(job_path).read_text())
    for key, value in job.get("env", {}).items():
        os.environ[key] = str(value)
    return job, {"ok": False, "kind": job["kind"], "name": job["name"]}


def run_job(job_path: str, result_path: str, work: Callable[[dict, dict], None]) -> None:
    """An engine's job: `work(job, result)` fills the result; if it raises, its error goes there (and
    the others need not wait for this engine). The result is written and the process ends at once
    (vLLM's threads would keep it alive)."""
    job, result = load_job(job_path)
    try:
        work(job, result)
        result["ok"] = True
    except BaseException as exc:  # the check reads the error
        mark_ready(job)
        result["error"] = f"{type(exc).__name__}: {exc}"
        result["traceback"] = traceback.format_exc()[-6000:]
    Path(job["workdir"], f"gone-{job['name']}").touch()  # as Turns.leave: the others skip its turns
    Path(result_path).write_text(json.dumps(result))
    sys.stdout.flush()
    os._exit(0)


def talker_job(job: dict, result: dict) -> None:
    kind = job["kind"]
    t0 = time.monotonic()
    engine, add = (omni_engine if kind == "omni" else shim_engine)(job)
    result["start_s"] = time.monotonic() - t0
    result["async_scheduling"] = bool(getattr(engine.vllm_config.scheduler_config, "async_scheduling", False))
    recorder = OutputRecorder(engine)
    drive(engine, add, talker_requests(job["warmup"], "warm-"))  # compiles the code predictor
    reqs = talker_requests(job["codes"], "codes-")
    run = drive(engine, add, reqs)
    if kind == "omni":
        run["codes"] = [omni_codes(recorder.by_request.get(r["rid"], [])) for r in reqs]
    else:
        from omni_sidecar.client import SidecarClient

        with SidecarClient(job["endpoint"]) as client:
            got = [client.outputs(r["rid"]) or {} for r in reqs]
        run["codes"] = [g["codes.audio"].tolist() if "codes.audio" in g else None for g in got]
    result["codes"] = run
    recorder.by_request.clear()
    recorder.active = False
    from worker_shim.omni_models.patches import patches_applied

    result["patches_engine"] = patches_applied()  # vllm-omni's own engine: its patches, found
    if kind == "shim":
        result["patches_workers"] = engine.collective_rpc("omni_sidecar_vllm_omni_patches")
    warm_bench_sets(engine, add, job)
    bench_ready(job)
    result["bench"], result["bench_rounds_cut"] = bench(engine, add, job)
    if kind == "shim":
        result["shim_stats"] = engine.collective_rpc("omni_sidecar_stats")


if __name__ == "__main__":
    run_job(sys.argv[1], sys.argv[2], talker_job)
