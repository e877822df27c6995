"""Where a speech request's first audio waits under concurrency: per-request timelines from inside
omni-serve's front end, two source trees side by side in one run.

  python bench/speech_timeline.py --tree base=/tmp/base --tree new=. --work /tmp/tl \
      --result /tmp/tl/timeline.json [--levels 16,64] [--rounds 2] [--frames 48] [--waves 1]
      [--limit-s 1500] [--pipeline TOML --voices A,B --sample-rate HZ] [--profile]

The pipeline: deploy/speech/tiny-h200-shape.toml unless given (the tiny CPU models in the H200
run's shape: 48 frames a request, the first chunk 1 frame then 25, 72 frames of left context, 64
requests a batch); on the H200, vllm-omni's Qwen3-TTS classes in the side-by-side run's config
(deploy/gpu/run_speech_timeline.sh).

Each tree's server is `omni-serve` from that tree (first on its PYTHONPATH) with probes put in from
outside (this file's `serve` mode; nothing of the tree is changed): the stage engines' `generate`
and the sidecar links wrapped, and a task that measures the event loop's lag. Per request, from its
HTTP arrival (ms): the talker's `generate` called (`talker_submit`), its first engine output
(`talker_out`), the first codec frame read from the talker's sidecar (`frames`), chunk 0's
code2wav `generate` called (`c0_submit`), its engine output (`c0_out`), its waveform read from the
code2wav sidecar (`c0_wave`) and the first audio handed to HTTP (`audio`); the client's TTFA
beside them. Per level: each milestone's p50/p95, the front end's event-loop lag (p50/p95/max of a
2 ms sleep's overshoot), its loop thread's CPU share and CPU per talker engine output (what bounds
the outputs a second it can take), per link the queries made and their mean wait (queueing in the
sidecar included), and the CPU seconds of each of the server's processes
(front end, sidecars, engine cores).

The trees take turns: per round and level, which goes first alternates, so a drifting machine hits
both alike; the JSON has every round's figures and their median over rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
GPU = ROOT / "deploy" / "gpu"
MILESTONES = ("talker_submit", "talker_out", "frames", "c0_submit", "c0_out", "c0_wave", "audio")
LAG_SLEEP_S = 0.002
START_TIMEOUT_S = 600


# ---- serve mode: omni-serve with probes, in the server's process ----

class Trace:
    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.requests: dict[str, dict[str, float]] = {}
        self.links: dict[str, dict[str, float]] = {}
        self.lags: list[float] = []
        self.outputs: dict[str, int] = {}  # talker engine outputs per request
        self.t0 = time.monotonic()
        self.cpu0 = time.thread_time()  # the loop thread's (reset runs on the loop)

    def mark(self, request_id: str, what: str, when: float | None = None) -> None:
        self.requests.setdefault(request_id, {}).setdefault(what, time.monotonic() if when is None else when)

    def dump(self) -> dict[str, Any]:
        wall = time.monotonic() - self.t0
        out = {"requests": self.requests, "links": self.links, "lags_ms": [round(x * 1000, 3) for x in self.lags],
               "talker_outputs": self.outputs, "wall_s": wall,
               "loop_cpu_share": (time.thread_time() - self.cpu0) / wall if wall > 0 else 0.0}
        self.reset()
        return out

    async def watch_loop(self) -> None:
        while True:
            t = time.monotonic()
            await asyncio.sleep(LAG_SLEEP_S)
            self.lags.append(time.monotonic() - t - LAG_SLEEP_S)


def speech_id(request_id: str) -> tuple[str, str | None]:
    """(the speech request's id, its code2wav chunk `cN` or None)."""
    base, _, chunk = request_id.rpartition("-")
    return (base, chunk) if base and chunk.startswith("c") and chunk[1:].isdigit() else (request_id, None)


class EngineProbe:
    def __init__(self, engine: Any, stage: str, trace: Trace) -> None:
        self._engine, self._stage, self._trace = engine, stage, trace

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    async def generate(self, prompt: Any, params: Any, request_id: str, *args: Any, **kwargs: Any):
        rid, chunk = speech_id(request_id)
        tag = "talker" if self._stage == "talker" else (chunk if chunk is not None else self._stage)
        trace = self._trace
        trace.mark(rid, f"{tag}_submit")
        async with contextlib.aclosing(self._engine.generate(prompt, params, request_id, *args, **kwargs)) as outs:
            async for out in outs:
                trace.mark(rid, f"{tag}_out")
                if self._stage == "talker":
                    trace.outputs[rid] = trace.outputs.get(rid, 0) + 1
                yield out


class LinkProbe:
    def __init__(self, link: Any, stage: str, trace: Trace) -> None:
        self._link, self._stage, self._trace = link, stage, trace
        self._waiting = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._link, name)

    def _count(self, kind: str, seconds: float) -> None:
        got = self._trace.links.setdefault(f"{self._stage}.{kind}", {"calls": 0, "wait_s": 0.0, "max_waiting": 0})
        got["calls"] += 1
        got["wait_s"] += seconds
        got["max_waiting"] = max(got["max_waiting"], self._waiting)

    async def _timed(self, kind: str, call: Any) -> Any:
        t = time.monotonic()
        self._waiting += 1
        try:
            return await call
        finally:
            self._waiting -= 1
            self._count(kind, time.monotonic() - t)

    async def outputs(self, req_id: str):
        values, got = await self._timed("outputs", self._link.outputs(req_id))
        rid, chunk = speech_id(req_id)
        codes = values.get("codes.audio")
        if chunk is None and codes is not None and getattr(codes, "shape", (0,))[0] > 0:
            self._trace.mark(rid, "frames")
        if chunk == "c0" and got.finished:
            self._trace.mark(rid, "c0_wave")
        return values, got

    async def follow(self, req_id: str, cursor: int):
        return await self._timed("follow", self._link.follow(req_id, cursor))

    async def forget(self, req_id: str) -> None:
        return await self._timed("forget", self._link.forget(req_id))


def serve(argv: list[str]) -> int:
    """omni-serve's own main with the probes in (its arguments as given)."""
    from fastapi.responses import JSONResponse

    from omni_serve import cli
    from omni_serve.api import server as api

    trace = Trace()
    start, audio, build_app = api.SpeechServer.start, api.SpeechServer.audio, api.build_app

    async def probed_start(self) -> None:
        await start(self)
        for stage in self.pipeline.stages:
            stage.engine = EngineProbe(stage.engine, stage.name, trace)
            stage.link = LinkProbe(stage.link, stage.name, trace)
        self._bench_lag = asyncio.create_task(trace.watch_loop())

    async def probed_audio(self, job, arrived):
        trace.mark(job.request_id, "arrived", arrived)
        async with contextlib.aclosing(audio(self, job, arrived)) as chunks:
            async for chunk in chunks:
                trace.mark(job.request_id, "audio")
                yield chunk

    def probed_app(server):
        app = build_app(server)

        @app.get("/bench/trace")
        async def dump() -> JSONResponse:
            return JSONResponse(trace.dump())

        return app

    api.SpeechServer.start, api.SpeechServer.audio, api.build_app = probed_start, probed_audio, probed_app
    return cli.main(argv)


# ---- the driver ----

def build_models(pipeline: Path) -> None:
    """The config's missing checkpoints, built here once (not by both servers at once)."""
    from omni_serve.config import load_callable, load_config

    for spec in load_config(pipeline).stages.values():
        if spec.build and not Path(spec.model).exists():
            load_callable(spec.build)(spec.model)


def process_label(proc: Any) -> str:
    """front end, a stage's sidecar (by its hooks) or an engine core (by its title)."""
    cmd = proc.cmdline()
    if "--hooks" in cmd:
        return "sidecar:" + cmd[cmd.index("--hooks") + 1]
    return proc.name()


def cpu_seconds(pid: int) -> dict[str, float]:
    """CPU seconds so far of the server's processes, by label (several of one label summed)."""
    import psutil

    root = psutil.Process(pid)
    out: dict[str, float] = {}
    for proc in [root, *root.children(recursive=True)]:
        with contextlib.suppress(psutil.Error):
            times = proc.cpu_times()
            label = "front_end" if proc.pid == pid else process_label(proc)
            out[label] = out.get(label, 0.0) + times.user + times.system
    return out


def profiler(pid: int, out: Path) -> subprocess.Popen:
    """py-spy sampling the front end's threads (its engines and sidecars are other processes)."""
    return subprocess.Popen(["py-spy", "record", "--pid", str(pid), "--rate", "250", "--format", "raw",
                             "--nonblocking", "--output", str(out)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


def summary(trace: dict[str, Any]) -> dict[str, Any]:
    """Each milestone's p50/p95 (ms from arrival) over the level's requests; lag, loop CPU, links."""
    rows = [r for r in trace["requests"].values() if "arrived" in r and "audio" in r]
    out: dict[str, Any] = {"requests": len(rows)}
    for m in MILESTONES:
        got = [(r[m] - r["arrived"]) * 1000 for r in rows if m in r]
        if got:
            out[m] = {"p50": round(percentile(got, 50), 1), "p95": round(percentile(got, 95), 1)}
    lags = trace["lags_ms"]
    if lags:
        out["loop_lag_ms"] = {"p50": round(percentile(lags, 50), 2), "p95": round(percentile(lags, 95), 2),
                              "max": round(max(lags), 2)}
    out["loop_cpu_share"] = round(trace["loop_cpu_share"], 3)
    outs = list(trace["talker_outputs"].values())
    if outs:
        out["talker_outputs_per_request"] = statistics.median(outs)
        # The front end's loop CPU per talker engine output: what bounds the outputs a second it can take.
        out["loop_cpu_us_per_talker_output"] = round(trace["loop_cpu_share"] * trace["wall_s"] / sum(outs) * 1e6, 1)
    out["links"] = {k: {"calls": v["calls"], "mean_wait_ms": round(v["wait_s"] / v["calls"] * 1000, 2),
                        "max_waiting": v["max_waiting"]} for k, v in trace["links"].items() if v["calls"]}
    return out


@contextlib.contextmanager
def servers(trees: dict[str, tuple[Path, Path]], work: Path):
    sys.path.insert(0, str(GPU))
    from speech_serving import free_port  # deploy/gpu/speech_serving.py

    procs: dict[str, tuple[subprocess.Popen, int]] = {}
    rpc = Path(tempfile.mkdtemp(prefix="vllm-rpc-"))  # the servers' vLLM IPC sockets, removed after them
    try:
        for name, (tree, pipeline) in trees.items():
            port = free_port()
            log = open(work / f"{name}.log", "w")
            # Idle OpenMP threads sleep: the servers share the host, and one's spinning engine threads
            # would starve the other's (on 2 cores, past the sidecar links' heartbeat timeout).
            # The tree first (its deploy/gpu too: a GPU config's speech prompt), then what was on the path
            # (a GPU run's installed bundle).
            path = os.pathsep.join([str(tree), str(tree / "deploy" / "gpu"), os.environ.get("PYTHONPATH", "")])
            env = {**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1", "OMP_WAIT_POLICY": "PASSIVE",
                   "VLLM_RPC_BASE_PATH": str(rpc)}
            cmd = [sys.executable, str(Path(__file__).resolve()), "serve", "--pipeline", str(pipeline),
                   "--port", str(port), "--run-dir", str(work / f"run-{name}"), "--uvicorn-log-level", "warning"]
            procs[name] = (subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=tree, env=env,
                                            start_new_session=True), port)
        yield {name: port for name, (_, port) in procs.items()}, {name: p.pid for name, (p, _) in procs.items()}
    finally:
        for proc, _ in procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
        for proc, _ in procs.values():
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
        shutil.rmtree(rpc, ignore_errors=True)


async def get_json(port: int, path: str) -> Any:
    from speech_serving import request

    got = await request(port, "GET", path, None, timeout_s=30)
    return json.loads(got.body) if got.status == 200 else None


async def wait_up(name: str, port: int, deadline: float, log: Path) -> None:
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError, ValueError, IndexError, asyncio.TimeoutError):
            if await get_json(port, "/health") is not None:
                print(f"{name} up", flush=True)
                return
        await asyncio.sleep(2)
    raise TimeoutError(f"{name} not up; its log:\n{log.read_text(errors='replace')[-3000:]}")


async def one_level(port: int, concurrency: int, args, deadline: float) -> dict[str, Any]:
    """`args.waves` x `concurrency` streaming requests, `concurrency` at a time (speech_serving's load
    client; 2 waves as its levels run); the server's trace of them."""
    from speech_serving import one_round, round_ttfa_ms

    await get_json(port, "/bench/trace")  # drops what came before
    client = await one_round(port, concurrency, args.waves * concurrency, args.frames, args.sample_rate, deadline,
                             args.voices)
    got = summary(await get_json(port, "/bench/trace"))
    if client.ttfa_ms:
        got["client_ttfa"] = {"p50": round(round_ttfa_ms(client, 50), 2), "p95": round(round_ttfa_ms(client, 95), 2)}
    got.update(ok=len(client.ttfa_ms), wall_s=client.wall_s)
    return got


def medians(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Per milestone and percentile, the median over rounds (and the rounds' min-max)."""
    out: dict[str, Any] = {}
    for key in (*MILESTONES, "client_ttfa", "loop_lag_ms"):
        for q in ("p50", "p95", "max"):
            vals = [r[key][q] for r in rounds if key in r and q in r[key]]
            if vals:
                out.setdefault(key, {})[q] = [round(statistics.median(vals), 1), round(min(vals), 1),
                                              round(max(vals), 1)]
    out["loop_cpu_share"] = round(statistics.median(r["loop_cpu_share"] for r in rounds), 3)
    per_output = [r["loop_cpu_us_per_talker_output"] for r in rounds if "loop_cpu_us_per_talker_output" in r]
    if per_output:
        out["loop_cpu_us_per_talker_output"] = [round(statistics.median(per_output), 1), min(per_output),
                                                max(per_output)]
    out["wall_s"] = round(statistics.median(r["wall_s"] for r in rounds), 2)
    return out


async def drive(args) -> dict[str, Any]:
    deadline = time.monotonic() + args.limit_s
    trees = {name: (tree, (pipeline or args.pipeline).resolve()) for name, (tree, pipeline) in args.trees.items()}
    for pipeline in {p for _, p in trees.values()}:
        build_models(pipeline)
    results: dict[str, Any] = {"trees": {k: [str(t), str(p)] for k, (t, p) in trees.items()}, "levels": args.levels,
                               "frames": args.frames, "rounds": {}, "median": {}}
    with servers(trees, args.work) as (ports, pids):
        await asyncio.gather(*(wait_up(n, p, deadline, args.work / f"{n}.log") for n, p in ports.items()))
        for port in ports.values():  # warm-up
            await one_level(port, 2, args, deadline)
        names = list(ports)
        for r in range(args.rounds):
            for i, c in enumerate(args.levels):
                order = names if (r + i) % 2 == 0 else names[::-1]
                for name in order:
                    if time.monotonic() > deadline:
                        results["note"] = "stopped at the limit"
                        return results
                    spy = profiler(pids[name], args.work / f"{name}-c{c}-r{r}.stacks") if args.profile else None
                    cpu0 = cpu_seconds(pids[name])
                    got = await one_level(ports[name], c, args, deadline)
                    cpu1 = cpu_seconds(pids[name])
                    got["cpu_s"] = {k: round(cpu1[k] - cpu0.get(k, 0.0), 2) for k in cpu1}
                    if spy is not None:
                        spy.send_signal(signal.SIGINT)
                        spy.wait(60)
                    results["rounds"].setdefault(name, {}).setdefault(str(c), []).append(got)
                    print(f"round {r} {name} @ {c}: " + json.dumps({k: got.get(k) for k in
                          ("client_ttfa", "talker_submit", "talker_out", "frames", "c0_submit", "c0_out", "c0_wave",
                           "audio", "loop_lag_ms", "loop_cpu_share", "loop_cpu_us_per_talker_output",
                           "wall_s")}), flush=True)
                    print("   links: " + json.dumps(got["links"]), flush=True)
                    print("   cpu_s: " + json.dumps(got["cpu_s"]), flush=True)
    for name, levels in results["rounds"].items():
        for c, rounds in levels.items():
            results["median"].setdefault(name, {})[c] = medians(rounds)
    return results


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "serve":
        sys.path.remove(str(HERE))  # the tree's packages, not this folder's modules
        return serve(sys.argv[2:])
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tree", action="append", required=True,
                   help="NAME=PATH[@TOML]: a source tree to serve from (with a pipeline of its own: a config "
                        "lever side by side)")
    p.add_argument("--work", type=Path, required=True)
    p.add_argument("--result", type=Path, required=True)
    p.add_argument("--levels", default="16,64")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--frames", type=int, default=48)
    p.add_argument("--waves", type=int, default=1, help="requests a level: this many times its concurrency")
    p.add_argument("--voices", default="default,vivian,ryan", help="the pipeline's voices, in turn")
    p.add_argument("--sample-rate", type=int, default=300, help="the pipeline's (the tiny codec's: 300)")
    p.add_argument("--pipeline", type=Path, default=ROOT / "deploy" / "speech" / "tiny-h200-shape.toml")
    p.add_argument("--limit-s", type=float, default=1500)
    p.add_argument("--profile", action="store_true",
                   help="py-spy (on PATH) samples each server's front end during each level: raw stacks in --work")
    args = p.parse_args()
    args.trees = {}
    for tree in args.tree:
        name, _, where = tree.partition("=")
        path, _, pipeline = where.partition("@")
        args.trees[name] = (Path(path).resolve(), Path(pipeline) if pipeline else None)
    args.levels = [int(c) for c in args.levels.split(",")]
    args.voices = tuple(v for v in args.voices.split(",") if v)
    args.work = args.work.resolve()
    args.work.mkdir(parents=True, exist_ok=True)
    results = asyncio.run(drive(args))
    args.result.parent.mkdir(parents=True, exist_ok=True)
    args.result.write_text(json.dumps(results, indent=1) + "\n")
    print(json.dumps(results["median"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
