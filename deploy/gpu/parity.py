"""GPU parity of vllm-omni's own Qwen3-TTS talker through shim + sidecar on upstream V2 against
vllm-omni's own runner: codes, and decode step times.

Engines, one process each (deploy/gpu/talker_engines.py), on the same tiny random checkpoint,
all started side by side on one GPU, per async-scheduling setting:
  omni: vllm-omni 0.26's AR worker and runner (vLLM 0.26's V1 runner under it),
  shim: upstream vLLM 0.26 V2 + the shim + `omni-sidecar serve --hooks omni-talker`,
  shim-eager-mtp (with --variants): the same with the shim's talker_mtp graphs off.
Checks: code 0 (the sampled tokens) and codes 1..Q-1 (the code predictor's, per decode step)
identical per request for 8 requests of different lengths (streaming and non-streaming text,
a prompt longer than a step: chunked prefill); FULL CUDA graphs captured. Figures: per bench set
(8, 16, 64 concurrent requests; greedy, and code 0 sampled), each engine's decode step
(talker_engines.drive), the ratio shim / omni of their medians, with the spread (each round's
ratio; each engine's p25-p75); py-spy stacks of the shim engine on one set, summarised.

  PYTHONPATH=.:SITE python3 deploy/gpu/parity.py --model DIR --out OUT
"""

from __future__ import annotations

import argparse
import json
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
from tiny_qwen3_tts import CODEBOOK  # noqa: E402

ENGINES = HERE / "talker_engines.py"
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


def engine_specs(args: argparse.Namespace) -> list[dict]:
    """One spec per engine: (kind, async scheduling, shim settings)."""
    out = []
    for mode in args.async_scheduling.split(","):
        on = mode == "on"
        out.append({"name": f"omni-async-{mode}", "kind": "omni", "async": on})
        for variant in args.variants.split(","):
            settings = {"talker_mtp_graphs": "off"} if variant == "shim-eager-mtp" else {}
            out.append({"name": f"{variant}-async-{mode}", "kind": "shim", "async": on, "shim_settings": settings})
    return out


def run(spec: dict, job: dict, work: Path, c: Check, gpus: str, timeout_s: float) -> dict:
    # vllm-omni's worker forces the V1 runner; the shim's engine is upstream's V2.
    env = {"CUDA_VISIBLE_DEVICES": gpus, "VLLM_USE_V2_MODEL_RUNNER": int(spec["kind"] == "shim")}
    overrides = {**job["engine_overrides"], "async_scheduling": spec["async"]}
    full = {**job, "kind": spec["kind"], "env": env, "engine_overrides": overrides,
            "shim_settings": spec.get("shim_settings", {}), "endpoint": spec.get("endpoint", ""),
            "profile": job["profile"] if spec["kind"] == "shim" and spec["name"].startswith("shim-") else None}
    try:
        res = run_engine(full, work, spec["name"], timeout_s=timeout_s, script=ENGINES)
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="a directory made by tiny_qwen3_tts.py")
    ap.add_argument("--out", default=tempfile.mkdtemp(prefix="omni-parity-"))
    ap.add_argument("--async-scheduling", default="off,on", help="off, on or off,on")
    ap.add_argument("--variants", default="shim", help="shim engines: shim, shim-eager-mtp (talker_mtp graphs off)")
    ap.add_argument("--concurrency", default="8,16,64")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--profile-set", default="c64-greedy", help="the bench set py-spy samples ('' for none)")
    ap.add_argument("--profile-s", type=float, default=6.0)
    ap.add_argument("--engine-timeout-s", type=float, default=420)
    ap.add_argument("--gpus", default="0")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    out.chmod(0o700)  # the sidecars' sockets live there
    concurrency = [int(n) for n in args.concurrency.split(",")]
    specs = engine_specs(args)
    job = {"model": args.model, "max_num_seqs": max(concurrency), "max_num_batched_tokens": 64, "warmup": WARMUP,
           "codes": CODES, "bench_sets": bench_sets(concurrency, args.rounds, args.max_tokens),
           "engine_overrides": {}, "engines": [s["name"] for s in specs],
           "gpu_memory_utilization": round(0.8 / len(specs), 3),
           "profile": {"set": args.profile_set, "seconds": args.profile_s} if args.profile_set else None}
    c = Check("talker: vllm-omni's Qwen3TTSTalkerForConditionalGeneration, shim + sidecar on V2 vs its own runner")
    t0 = time.monotonic()
    sidecars = {}
    results: dict = {}
    try:
        for spec in specs:
            if spec["kind"] == "shim":
                sidecars[spec["name"]] = sidecar(out, f"{spec['name']}-sidecar", "omni-talker", args.gpus)
                spec["endpoint"] = sidecars[spec["name"]].endpoint
        with ThreadPoolExecutor(len(specs)) as pool:
            futures = {s["name"]: pool.submit(run, s, job, out, c, args.gpus, args.engine_timeout_s) for s in specs}
            results = {name: f.result() for name, f in futures.items()}
    finally:
        for sc in sidecars.values():
            sc.stop()
    report: dict = {"engines": {}, "codes": {}, "steps": {}}
    for spec in specs:
        res = results.get(spec["name"], {})
        log = Path(res.get("log_path", "")).read_text() if Path(res.get("log_path", "") or "/-").is_file() else ""
        report["engines"][spec["name"]] = {
            "ok": res.get("ok"), "error": res.get("error"), "start_s": res.get("start_s"),
            "async_scheduling": spec["async"], "shim_settings": spec.get("shim_settings"),
            "graphs": sorted({ln[ln.index("Capturing CUDA graphs"):][:80] for ln in log.splitlines()
                              if "Capturing CUDA graphs" in ln}),
            "shim_stats": res.get("shim_stats")}
        if spec["kind"] == "shim" and res.get("ok"):
            c.expect("Using V2 Model Runner" in log, f"{spec['name']}: the V2 runner was not used")
            c.expect(FULL_GRAPHS in log, f"{spec['name']}: no FULL CUDA graphs captured")
        if spec["kind"] != "shim":
            continue
        omni = results.get(f"omni-async-{'on' if spec['async'] else 'off'}", {})
        if omni.get("ok") and res.get("ok"):
            report["codes"][spec["name"]] = compare_codes(omni, res, spec["name"], c)
            report["steps"][spec["name"]] = ratios(omni, res)
        prof = out / f"{spec['name']}.pyspy.txt"
        if prof.is_file():
            (out / f"profile-{spec['name']}.txt").write_text(summarise_profile(prof))
    report["check"] = c.report()
    report["wall_s"] = round(time.monotonic() - t0, 1)
    (out / "parity.json").write_text(json.dumps(report, indent=1))
    for name, sets in report["steps"].items():
        for set_name, r in sets.items():
            print(f"{name:28s} {set_name:12s} omni {r['omni']['median_ms']:7.3f} ms  shim {r['shim']['median_ms']:7.3f} "
                  f"ms  ratio {r['ratio']:.3f}  rounds {r['round_ratios']}", flush=True)


if __name__ == "__main__":
    main()
