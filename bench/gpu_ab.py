"""Decode throughput shim / plain V2 on ONE device: all engines resident in this process.

For each configuration (model x hook set) this driver process holds three vLLM engines at
once, each in its own engine-core process (`VLLM_ENABLE_V1_MULTIPROCESSING=1`) with a
share of the GPU's memory: plain V2; V2 with the shim talking to a sidecar; and the
in-process baseline (bench/inproc.py: the same shim, the same hook set called in the
worker, no sidecar), whose comparison with the shim prices the process boundary.
It then runs many short rounds (N requests x T tokens, greedy, `ignore_eos`) alternating
between them in palindromic blocks (ABCCBA, BCAACB, ...; with two engines ABBA / BAAB) and
records each round's tokens/s; bench/ab_stats.py turns the rounds into median block ratios
per pair of engines, their bootstrap intervals and spread, and what an engine adds per step.

Configurations: `passthrough` (the sidecar does nothing; default CUDA graphs) and `omni`
(the omni hook set working every step: extra kwargs through a blocking plan each step,
last-layer and two captured layers' hidden states each token, prefill overlays from each
request's `prompt_embeds`). The shim refuses extra kwargs under FULL CUDA graphs
(docs/ARCHITECTURE.md, "Extra kwargs and CUDA graphs"), so all engines of an `omni`
configuration run PIECEWISE graphs: like with like.

Everything is bounded by a `Budget`: a configuration starts only if its engines' start
(estimated from the starts seen so far) and its shortest measurement fit, rounds stop at
the deadline, and `sink(results)` is called after every block so a cut-short run leaves
its figures behind.
"""

from __future__ import annotations

import gc
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from bench.ab_stats import block_order, step_pace, step_price, summarize
from bench.gpu_models import (GC_PROBE_ENV, GC_PROBE_WRITE_S, KWARGS_MARK_ENV, SHAPES, build_model_dir,
                               engine_kwargs, omni_hook_options, param_count, read_gc_probe)
from bench.gpu_profile import ProfileRecorder
from bench.pinning import child_pids, pin_all, plan

# Engines a configuration holds besides plain V2: the shim with a sidecar, and the bench's
# in-process baseline (the same hooks called in the worker, bench/inproc.py).
WORKERS = {"shim": "worker_shim.Worker", "inproc": "bench.inproc_worker.Worker"}

CONFIGS: dict[str, tuple[str, str]] = {  # name -> (model, hook set); run in this order
    "tiny-passthrough": ("tiny", "passthrough"),
    "tiny-omni": ("tiny", "omni"),
    "1b-passthrough": ("1b", "passthrough"),
    "1b-omni": ("1b", "omni"),
}


@dataclass
class Sizes:
    num: int = 64  # requests per round (= max_num_seqs)
    prompt_len: int = 16
    max_tokens: dict[str, int] = field(default_factory=lambda: {"tiny": 128, "1b": 128})
    measure_s: float = 22.0  # timed rounds per configuration, after warm-up
    min_blocks: int = 3
    max_blocks: int = 200
    start_guess_s: float = 60.0  # one engine's start before any was seen
    smoke: bool = False
    engines: tuple[str, ...] = ("plain", "shim", "inproc")  # plain first: the others compare to it
    pin: bool = False  # `--pin`: each engine and the sidecar on cores of their own (bench/pinning.py: it hurt)
    profile_s: float = 0.0  # `--profile-s`: py-spy on every engine for the timed rounds' first seconds
    profile_dir: str = ""  # where the raw stacks go (bench.gpu's --out)
    profile_idle: bool = False  # `--profile-idle`: waiting threads sampled too

    @classmethod
    def smoke_sizes(cls) -> "Sizes":
        return cls(num=4, prompt_len=8, max_tokens={"tiny": 8, "1b": 8}, measure_s=0.0, min_blocks=2,
                   max_blocks=2, start_guess_s=25.0, smoke=True)


class Budget:
    def __init__(self, seconds: float) -> None:
        self.t0 = time.monotonic()
        self.deadline = self.t0 + seconds

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def elapsed(self) -> float:
        return time.monotonic() - self.t0


def _prompts(sizes: Sizes, hidden: int, payloads: bool, max_tokens: int, dtype: str) -> tuple[list, list]:
    """Token-id prompts (fixed seed) and their params; with `payloads`, each carries prompt_embeds
    (in the model's dtype; every engine gets the same params, so all pay for the bytes)."""
    import numpy as np
    import torch
    from vllm import SamplingParams

    from omni_sidecar.payload import sidecar_extra_args

    rng = np.random.default_rng(15)
    prompts, params = [], []
    for _ in range(sizes.num):
        prompts.append({"prompt_token_ids": rng.integers(4, 380, sizes.prompt_len).tolist()})
        extra = None
        if payloads:
            embeds = torch.from_numpy((rng.standard_normal((sizes.prompt_len, hidden)) * 0.02).astype(np.float32))
            embeds = embeds.to(getattr(torch, dtype))
            extra = sidecar_extra_args(prompt_embeds=embeds)
        params.append(SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, extra_args=extra))
    return prompts, params


def _host_ticks() -> tuple[int, int]:
    """(steal, busy) clock ticks of the whole host so far (/proc/stat; zeros where there is none): a
    round that lost CPU to other tenants of a virtual machine shows it as steal."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return 0, 0
    user, nice, system, _idle, _iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
    return steal, user + nice + system + irq + softirq


class StepStamps:
    """The engine core's timestamps of the step outputs the driver receives (vLLM stamps each
    EngineCoreOutputs with time.monotonic() in the core process when the step produced it): one
    per engine step that produced tokens, so their gaps are the engine's step periods, free of the
    driver's own jitter. Wraps this engine's `engine_core.get_output` (the bench's instrument, the
    same on every engine; vLLM unchanged)."""

    def __init__(self, llm) -> None:
        self.stamps: list[float] = []
        core = llm.llm_engine.engine_core
        fetch = core.get_output

        def get_output(*args, **kwargs):
            out = fetch(*args, **kwargs)
            if getattr(out, "outputs", None):
                self.stamps.append(out.timestamp)
            return out

        core.get_output = get_output

    def take(self) -> list[float]:
        stamps, self.stamps = self.stamps, []
        return stamps


def _round(llm, prompts, params, stamps: StepStamps | None = None) -> tuple[int, float, float | None]:
    """(tokens, seconds, median step period in ms from the core's stamps, None without `stamps`)."""
    # The driver holds three engines' heaps: a full collection landing inside a round costs it
    # tens of ms at random (rounds of the same work ranged 0.37..0.72 s with the collector on).
    # Collect between rounds, never inside one, the same for every engine.
    gc.collect()
    gc.disable()
    if stamps is not None:
        stamps.take()
    try:
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        dt = time.perf_counter() - t0
    finally:
        gc.enable()
    pace = step_pace(stamps.take()) if stamps is not None else None
    return sum(len(o.outputs[0].token_ids) for o in outs), dt, pace


def _shutdown(llm) -> None:
    core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    if core is not None:
        core.shutdown()


def _scalar_stats(stats: dict) -> dict:
    """The stats' scalars, and the counters kept as dicts flattened (`ring_counts_kicks`, ...)."""
    flat: dict = {}
    for k, v in stats.items():
        if k in ("ring_counts", "arena_opens") and isinstance(v, dict):
            flat.update({f"{k}_{sub}": x for sub, x in v.items()})
        else:
            flat[k] = v
    return {k: (round(v, 2) if isinstance(v, float) else v) for k, v in flat.items()
            if isinstance(v, (int, float, str, bool))}


def _steps(llm) -> int:
    """The engine's step count so far as its shim counts it (shim and in-process engines only)."""
    (stats,) = llm.collective_rpc("omni_sidecar_stats")
    return int(stats["steps"])


def _measure(res: dict, engines: dict, prompts, params, sizes: Sizes, budget: Budget, sink) -> None:
    """Timed blocks (bench/ab_stats.py's order) until the measuring time or the budget is spent."""
    names = sizes.engines
    stamps = {name: StepStamps(engines[name]) for name in names}
    t_measure = time.monotonic()
    block = 0
    while block < sizes.max_blocks:
        if block >= sizes.min_blocks and time.monotonic() - t_measure >= sizes.measure_s:
            break
        if block >= 1 and budget.left() < 2 * len(names) * (res["rounds"][-1]["s"] + 0.5) + 10:
            res["cut_by_budget"] = True
            break
        for engine in block_order(block, names):
            steal0, busy0 = _host_ticks()
            tokens, dt, pace = _round(engines[engine], prompts, params, stamps[engine])
            steal1, busy1 = _host_ticks()
            res["rounds"].append({"block": block, "engine": engine, "tokens": tokens, "s": round(dt, 4),
                                  "tok_s": round(tokens / dt, 2),
                                  "step_ms": None if pace is None else round(pace, 5),
                                  "host_steal_ticks": steal1 - steal0,
                                  "host_busy_ticks": busy1 - busy0})
        block += 1
        _summaries(res, names)
        sink(res)


def _summaries(res: dict, names: tuple[str, ...]) -> None:
    """shim / plain (`summary`), and with the in-process baseline: inproc / plain and shim / inproc
    (the process boundary's price in throughput), and what each adds per engine step in µs."""
    rounds = res["rounds"]
    res["summary"] = summarize(rounds)
    res["pace"] = {"shim_vs_plain": summarize(rounds, key="step_ms")}
    if "inproc" not in names:
        return
    res["summary_inproc"] = summarize(rounds, "inproc", "plain")
    res["summary_boundary"] = summarize(rounds, "shim", "inproc")
    res["pace"].update(inproc_vs_plain=summarize(rounds, "inproc", "plain", "step_ms"),
                       shim_vs_inproc=summarize(rounds, "shim", "inproc", "step_ms"))
    counted = list((res.get("steps_per_round") or {}).values())
    steps = sum(counted) / len(counted) if counted else 0  # none yet while measuring
    res["step_price"] = {f"{a}_vs_{b}": step_price(rounds, a, b, steps)
                         for a, b in (("shim", "inproc"), ("shim", "plain"), ("inproc", "plain"))}


def _pairs(res: dict) -> list[tuple[str, dict]]:
    return [(label, res[key]) for key, label in (("summary", "shim/plain"), ("summary_inproc", "inproc/plain"),
                                                 ("summary_boundary", "shim/inproc")) if res.get(key)]


def run_config(name: str, work: Path, sizes: Sizes, budget: Budget, starts: list[float],
               sink: Callable[[dict], None]) -> dict:
    """One configuration: sidecar, the engines (plain, shim, in-process baseline), warm-up,
    alternating blocks; `sink` after each block."""
    from vllm import LLM

    from bench.inproc_worker import inproc_config
    from tests.support.procs import SidecarProcess

    model, hooks = CONFIGS[name]
    shape = "mid" if (sizes.smoke and model == "1b") else model
    graphs = "PIECEWISE" if hooks == "omni" else "FULL_AND_PIECEWISE"
    kwargs = engine_kwargs(build_model_dir(work, shape), smoke=sizes.smoke, graphs=graphs, num_seqs=sizes.num)
    res: dict = {"config": name, "model": shape, "params_m": round(param_count(SHAPES[shape]) / 1e6, 2),
                 "hooks": hooks, "hook_options": omni_hook_options(shape) if hooks == "omni" else [],
                 "graphs": "eager" if sizes.smoke else graphs, "dtype": kwargs["dtype"],
                 "requests": sizes.num, "prompt_len": sizes.prompt_len, "max_tokens": sizes.max_tokens[model],
                 "status": "starting", "rounds": []}
    sink(res)
    endpoint = f"ipc://{work}/{name}.sock"
    engines: dict = {}
    marks = {e: work / f"{name}-kwargs{'' if e == 'shim' else '-' + e}.json" for e in ("shim", "inproc")}
    gc_files = {e: work / f"{name}-gc-{e}.json" for e in sizes.engines}
    sidecar = None
    try:
        sidecar = SidecarProcess(endpoint, hooks, work / f"{name}-sidecar.log", options=res["hook_options"],
                                 extra_args=["--keep-finished", "256", "--log-level", "WARNING"])
        # All get the same additional_config (plain ignores both keys, the shim the in-process one):
        # it enters vLLM's compile-cache key and worker_cls does not, so a later engine reuses an
        # earlier one's compiled graphs where the shim adds none of its own (pass-through).
        config = {"omni_sidecar": {"endpoint": endpoint}, **inproc_config(hooks, res["hook_options"])}
        processes: dict[str, set[int]] = {"driver": {os.getpid()}, "sidecar": {sidecar.proc.pid}}
        for engine in sizes.engines:
            t0 = time.monotonic()
            extra: dict = {"additional_config": config}
            os.environ[GC_PROBE_ENV] = str(gc_files[engine])  # its engine core inherits it (fork or spawn)
            if engine != "plain":
                extra["worker_cls"] = WORKERS[engine]
                os.environ[KWARGS_MARK_ENV] = str(marks[engine])  # its engine core inherits it (fork or spawn)
            before = child_pids()
            engines[engine] = LLM(**kwargs, **extra)
            processes[engine] = child_pids() - before - processes["sidecar"]
            starts.append(time.monotonic() - t0)
            res[f"{engine}_start_s"] = round(starts[-1], 1)
            print(f"[{name}] {engine} engine up in {starts[-1]:.1f} s ({budget.left():.0f} s of budget left)",
                  flush=True)
        if sizes.pin and not sizes.smoke:
            cores = plan({name: (1 if name == "sidecar" else 2) for name in processes})
            res["pinning"] = pin_all(processes, cores) if cores else "not pinned: too few CPUs for a core set each"
            print(f"[{name}] pinning: {res['pinning']}", flush=True)
        prompts, params = _prompts(sizes, SHAPES[shape]["hidden_size"], hooks == "omni", sizes.max_tokens[model],
                                   kwargs["dtype"])
        for engine in sizes.engines + sizes.engines:  # warm-up: graphs, allocator, sidecar paths
            _round(engines[engine], prompts, params)
        hooked = [e for e in sizes.engines if e != "plain"]
        steps_before = {e: _steps(engines[e]) for e in hooked}  # the shims count the timed rounds' steps
        res["status"] = "measuring"
        profiler = ProfileRecorder.maybe(Path(sizes.profile_dir or work), name, sizes.profile_s, sizes.profile_idle)
        if profiler is not None:
            profiler.start(processes)
        try:
            _measure(res, engines, prompts, params, sizes, budget, sink)
        finally:
            if profiler is not None:
                res["profile"] = profiler.finish()
        # A round's step count varies by one (the engine core may start a step before the driver
        # added every request), so per engine: the mean over its timed rounds.
        res["steps_per_round"] = {e: round((_steps(engines[e]) - steps_before[e]) /
                                           max(1, sum(r["engine"] == e for r in res["rounds"])), 2) for e in hooked}
        _summaries(res, sizes.engines)
        time.sleep(GC_PROBE_WRITE_S + 0.1)  # then a round each: every probe writes what it counted
        for engine in sizes.engines:
            _round(engines[engine], prompts, params)
        res["gc"] = {e: read_gc_probe(gc_files[e]) for e in sizes.engines}
        print(f"[{name}] the cycle collector in each engine's process: {json.dumps(res['gc'])}", flush=True)
        for engine in sizes.engines:
            if engine != "plain":
                (stats,) = engines[engine].collective_rpc("omni_sidecar_stats")
                res[f"{engine}_stats"] = _scalar_stats(stats)
                # Did the hooks' extra kwargs reach the model's forward (omni)?
                mark = marks[engine]
                res["kwargs_reached_model" if engine == "shim" else f"kwargs_reached_model_{engine}"] = (
                    json.loads(mark.read_text()) if mark.exists() else None)
        res["sidecar_sessions"] = _sidecar_sessions(endpoint)
        res["status"] = "done"
        for label, s in _pairs(res):
            print(f"[{name}] {s.get('blocks')} blocks: {label} median {s.get('ratio_median')} "
                  f"CI95 {s.get('ratio_ci95')} halves {s.get('halves')} | {s.get('verdict')}", flush=True)
        for label, s in (res.get("pace") or {}).items():
            print(f"[{name}] step pace {label}: median {s.get('ratio_median')} CI95 {s.get('ratio_ci95')} "
                  f"halves {s.get('halves')} | {s.get('verdict')}", flush=True)
        if res.get("step_price"):
            print(f"[{name}] per step: {json.dumps(res['step_price'])}", flush=True)
    except Exception as exc:  # a configuration that fails leaves the others' figures standing
        res["status"] = "failed"
        res["error"] = f"{type(exc).__name__}: {exc}"[:2000]
        print(f"[{name}] FAILED: {res['error']}", flush=True)
    finally:
        os.environ.pop(KWARGS_MARK_ENV, None)
        os.environ.pop(GC_PROBE_ENV, None)
        for llm in engines.values():
            try:
                _shutdown(llm)
            except Exception:
                pass
        engines.clear()
        if sidecar is not None:
            sidecar.stop()
        import gc

        gc.collect()
        sink(res)
    return res


def _sidecar_sessions(endpoint: str) -> list[dict]:
    """What the sidecar counted per session (the shim's and the in-process engine's are not its):
    steps, plans built ahead and used (a steady decode step whose plan was ready when its StepBegin
    came), stacked rows, its own step latency; and the sidecar's cycle collections (between steps,
    elsewhere, the longest pause: omni_sidecar/serve/collector.py)."""
    from omni_sidecar.client import SidecarClient

    keep = ("steps", "plans_ahead_built", "plans_ahead_used", "stacked_rows", "step_latency_us_p50",
            "step_latency_us_p99")
    try:
        with SidecarClient(endpoint) as client:
            status = client.status()
        collector = {**{f"collections_{where}": n for where, n in status.collections.items()},
                     "collection_pause_us_max": status.collection_pause_us_max}
        return [{**{k: getattr(s, k) for k in keep}, **collector} for s in status.sessions]
    except Exception as exc:  # a figure less, not a failed configuration
        return [{"error": f"{type(exc).__name__}: {exc}"[:300]}]


def run_all(names: list[str], work: Path, sizes: Sizes, budget: Budget, sink: Callable[[list[dict]], None]) -> list[dict]:
    """The configurations in order, each only if its starts and shortest measurement fit the budget."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"  # each engine core in a process of its own
    results: list[dict] = []
    starts: list[float] = []

    def put(res: dict) -> None:
        if not results or results[-1] is not res:
            results.append(res)
        sink(results)

    for name in names:
        start_est = max(starts[-2:]) if starts else sizes.start_guess_s
        if name.startswith("1b") and not sizes.smoke and not any(r["config"].startswith("1b") for r in results):
            start_est *= 1.5  # a larger model's first compile
        need = len(sizes.engines) * start_est + 12 + (0 if sizes.smoke else min(sizes.measure_s, 15.0))
        if budget.left() < need:
            results.append({"config": name, "status": "skipped", "rounds": [],
                            "error": f"budget: {budget.left():.0f} s left, ~{need:.0f} s needed"})
            print(f"[{name}] skipped: {results[-1]['error']}", flush=True)
            sink(results)
            continue
        run_config(name, work, sizes, budget, starts, put)
    return results
