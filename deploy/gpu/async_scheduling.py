"""Async scheduling on and off with every hook set, on one GPU (vLLM 0.26): the same results, and
the step time with it on no worse than with it off (docs/ARCHITECTURE.md, "Async scheduling").

  [ASYNC_LIMIT_S=420] sh deploy/gpu/run_async.sh BUNDLE_DIR OUT_DIR [options...]
  PYTHONPATH=.:/tmp/omni-site python3 deploy/gpu/async_scheduling.py --tts-model DIR --out OUT [options...]

Sets: `passthrough`, `capture`, `overlay` and `omni` on the tiny Llama (deploy/gpu/async_engines.py),
`talker` (the tiny Qwen3-TTS talker with its own hooks, `omni-talker`; talker_engines.py) and
`code2wav` (`omni-code2wav`; code2wav_engines.py), each run twice, async scheduling on and off,
every engine side by side on the GPU (their start-up is most of the wall time), each with a
sidecar of its own. Some requests carry stop token ids: the case async scheduling runs once more.

Per set, on against off: tokens (and finish reasons) identical; every output the sidecar kept the
same shape and, in bf16, close (captured rows, omni outputs; talker codes identical; the code2wav
waveform within 5% of its peak); at least one request ended on a stop token where the set has
stop tokens; each engine ran as asked (on / off). A set passes on these.

Timing (every set but code2wav, a step per chunk): timed rounds of TIMED_REQUESTS requests of
`--tokens` tokens each (no stop tokens), every engine's round in its turn, the turns of a set's two
engines adjacent and their order reversed every other round (ABBA; talker_engines.Turns). The
measure is the same for both modes: each request's decode time per token as its client sees it
(talker_engines.drive), a round's figure their median; async scheduling runs another number of
forwards and engine steps for the same tokens (kept per round beside it), so time per forward would
compare different things. Per round the ratio on / off; the figure is their median, with min..max
and the bootstrap 95 % interval of the median (parity.round_spread). Verdict: "on no worse than off"
when the interval's upper end is <= 1 + `--tolerance`, "on slower than off" when its lower end is
above it, else "not resolved" (and with fewer than MIN_ROUNDS rounds); a verdict, not a pass or fail
of the set. Writes OUT/async-scheduling.json (every round's figures of both engines) and prints a table.

`--plan` prints the engines it would start and exits (no vLLM needed: argument handling on any host).
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
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))

SETS = ["passthrough", "capture", "overlay", "omni", "talker", "code2wav"]
LLAMA_SETS = {"passthrough": "passthrough", "capture": "capture", "overlay": "overlay", "omni": "omni"}
SCRIPTS = {"talker": HERE / "talker_engines.py", "code2wav": HERE / "code2wav_engines.py"}
HOOKS = {**LLAMA_SETS, "talker": "omni-talker", "code2wav": "omni-code2wav"}
ATOL = RTOL = 5e-2  # bf16, as deploy/gpu/acceptance.py's capture check
CODE2WAV_RTOL = 0.05  # of the waveform's peak, as deploy/gpu/parity.py
PROMPT_LENS = [3, 7, 12, 20, 33, 50, 90]
EMBEDS_LENS = [5, 40, 100]  # 100 > max_num_batched_tokens=64: chunked prefill crosses overlay rows
# Llama requests ending on any of these (greedy: the same token on and off) stop early.
LLAMA_STOPS = list(range(10, 380, 4))
TALKER_STOPS = list(range(3, 64, 5))  # code-0 values of the tiny talker's codebook (64 codes)
TALKER_CODES = [dict(text_len=n, streaming=s, max_tokens=t, seed=i, **({"stop_token_ids": TALKER_STOPS} if i % 2 else {}))
                for i, (n, s, t) in enumerate([(3, True, 24), (12, False, 40), (30, True, 32), (5, False, 48),
                                               (20, True, 36), (8, False, 30)])]
TALKER_WARMUP = [dict(text_len=4, streaming=True, max_tokens=4, seed=90),
                 dict(text_len=6, streaming=False, max_tokens=4, seed=91)]
CODE2WAV_REQUESTS = [dict(frames=n, seed=s) for n, s in ((40, 1), (75, 2))]
CODE2WAV_CHUNKINGS = [{"codec_chunk_frames": 25, "codec_left_context_frames": 72}]
# The timed rounds: a round decodes TIMED_TOKENS steps of TIMED_REQUESTS requests (~0.5-0.8 s on the
# H200 for the tiny models, ~3 ms a step; rounds of 64 steps, 0.2 s, moved a round's ratio by up to
# 0.5), ROUNDS of them by default.
TIMED_REQUESTS = 16
TIMED_TOKENS = 192
MAX_TIMED_TOKENS = 400  # the engines' max_model_len (512) less the longest prompt (PROMPT_LENS)
ROUNDS = 10
MIN_ROUNDS = 4  # fewer paired rounds resolve nothing
REPORT_S = 30  # of --limit-s, kept for the engines' results and the report once the rounds are cut
TIMED_SETS = [s for s in SETS if s != "code2wav"]


def llama_requests(embeds_files: list[str] | None) -> list[dict]:
    import numpy as np

    if embeds_files is not None:  # the overlay set
        return [{"embeds_file": f, "max_tokens": 16} for f in embeds_files]
    rng = np.random.default_rng(1)
    return [{"token_ids": rng.integers(4, 380, n).tolist(), "max_tokens": 24,
             **({"stop_token_ids": LLAMA_STOPS} if i % 2 == 0 else {})} for i, n in enumerate(PROMPT_LENS)]


def llama_timed_requests(embeds_files: list[str] | None, tokens: int = TIMED_TOKENS) -> list[dict]:
    """TIMED_REQUESTS requests of `tokens` tokens, no stop tokens: the prompt lengths (or, for the
    overlay set, the embeds files) in turn."""
    import numpy as np

    if embeds_files is not None:
        return [{"embeds_file": embeds_files[i % len(embeds_files)], "max_tokens": tokens}
                for i in range(TIMED_REQUESTS)]
    rng = np.random.default_rng(2)
    return [{"token_ids": rng.integers(4, 380, PROMPT_LENS[i % len(PROMPT_LENS)]).tolist(), "max_tokens": tokens}
            for i in range(TIMED_REQUESTS)]


def engine_specs(sets: list[str]) -> list[dict]:
    """Two engines a set: async scheduling on, then off."""
    return [{"name": f"{s}-async-{mode}", "set": s, "async": mode == "on", "hooks": HOOKS[s],
             "script": str(SCRIPTS.get(s, HERE / "async_engines.py"))} for s in sets for mode in ("on", "off")]


def job_for(spec: dict, args: argparse.Namespace, llama: str, embeds_files: list[str], n_engines: int,
            deadline_unix: float) -> dict:
    """`spec`'s engine job. Every timed engine's job names all timed engines in one order, a set's
    two adjacent (on, off): Turns runs them so, reversed every other round."""
    timed = [s for s in engine_specs(args.sets) if s["set"] in TIMED_SETS]
    bench = [{"name": "timed", "rounds": args.rounds, "temperature": 0.0,
              "reqs": [dict(text_len=16 + (i % 5) * 4, streaming=True, max_tokens=args.tokens, seed=100 + i)
                       for i in range(TIMED_REQUESTS)]}]
    # vllm-omni is installed beside vLLM here: its plugin would patch every engine (the shim refuses that)
    env = {"CUDA_VISIBLE_DEVICES": args.gpu, "VLLM_USE_V2_MODEL_RUNNER": 1, "VLLM_PLUGINS": "omni_sidecar_shim"}
    common = {"endpoint": spec["endpoint"], "env": env, "engines": [s["name"] for s in timed],
              "barrier": [s["name"] for s in timed], "bench_sets": bench, "deadline_unix": deadline_unix,
              "gpu_memory_utilization": round(0.8 / n_engines, 3)}
    if spec["set"] in LLAMA_SETS:
        overlay = embeds_files if spec["set"] == "overlay" else None
        return {**common, "kind": "shim", "model": llama, "async": spec["async"],
                "requests": llama_requests(overlay), "timed_requests": llama_timed_requests(overlay, args.tokens)}
    tts = {**common, "kind": "shim", "model": args.tts_model, "engine_overrides": {"async_scheduling": spec["async"]},
           "shim_settings": {}, "profile": None, "max_num_seqs": TIMED_REQUESTS, "max_num_batched_tokens": 64}
    if spec["set"] == "talker":
        return {**tts, "warmup": TALKER_WARMUP, "codes": TALKER_CODES}
    return {**tts, "requests": CODE2WAV_REQUESTS, "chunkings": CODE2WAV_CHUNKINGS}


# -- comparison (pure: tests/test_deploy.py runs it on CPU) -------------------------------------------


def compare_arrays(name: str, on: Any, off: Any, atol: float = ATOL, rtol: float = RTOL) -> tuple[bool, str, float]:
    """(same, why not, max abs diff) of two outputs: the same shape, then close."""
    import numpy as np

    a, b = np.asarray(on, dtype=np.float64), np.asarray(off, dtype=np.float64)
    if a.shape != b.shape:
        return False, f"{name}: shape {list(a.shape)} with async scheduling on, {list(b.shape)} off", float("nan")
    diff = float(np.abs(a - b).max()) if a.size else 0.0
    if not np.allclose(a, b, atol=atol, rtol=rtol):
        return False, f"{name}: max abs diff {diff:.4g} beyond atol {atol} rtol {rtol}", diff
    return True, "", diff


def compare_set(name: str, on: dict, off: dict) -> dict:
    """One set's results, on against off: {"ok", "failures", figures}."""
    import numpy as np

    failures: list[str] = []
    figures: dict[str, Any] = {}
    for res, mode in ((on, "on"), (off, "off")):
        if not res.get("ok"):
            failures.append(f"async {mode}: {res.get('error', 'no result')}")
    if failures:
        return {"set": name, "ok": False, "failures": failures, "figures": figures}
    asked = {"on": on.get("async_scheduling"), "off": off.get("async_scheduling")}
    if asked != {"on": True, "off": False}:
        failures.append(f"async scheduling was {asked} (asked on / off)")
    if name == "code2wav":
        worst = 0.0
        for rid, wave in off["waveforms"].items():
            other = on["waveforms"].get(rid)
            if wave is None or other is None:
                failures.append(f"{rid}: no waveform (on: {other is not None}, off: {wave is not None})")
                continue
            peak = max((abs(x) for x in wave), default=0.0)
            same, why, diff = compare_arrays(rid, other, wave, atol=CODE2WAV_RTOL * peak, rtol=0.0)
            worst = max(worst, diff if diff == diff else 0.0)
            if not same:
                failures.append(why)
        figures["waveform_max_abs_diff"] = round(worst, 5)
    elif name == "talker":
        a, b = on["codes"], off["codes"]
        figures["identical_tokens"] = f"{sum(x == y for x, y in zip(a['tokens'], b['tokens']))}/{len(b['tokens'])}"
        if a["tokens"] != b["tokens"]:
            failures.append("talker tokens differ")
        for i, (x, y) in enumerate(zip(a["codes"], b["codes"])):
            if x != y:
                failures.append(f"request {i}: codes differ ({len(x or [])} frames on, {len(y or [])} off)")
        stops = sum(len(t or []) < spec["max_tokens"] for t, spec in zip(b["tokens"], TALKER_CODES))
        figures["stopped_by_token"] = stops
    else:
        a, b = on["run"], off["run"]
        figures["identical_tokens"] = f"{sum(x == y for x, y in zip(a['tokens'], b['tokens']))}/{len(b['tokens'])}"
        if a["tokens"] != b["tokens"]:
            failures.append("tokens differ")
        if a["finish_reasons"] != b["finish_reasons"]:
            failures.append(f"finish reasons differ: {a['finish_reasons']} on, {b['finish_reasons']} off")
        figures["stopped_by_token"] = sum(r == "stop" for r in b["finish_reasons"])
        worst, compared = 0.0, 0
        for rid_on, rid_off in zip(a["ids"], b["ids"]):
            files_on, files_off = a["outputs"].get(rid_on, {}), b["outputs"].get(rid_off, {})
            if set(files_on) != set(files_off):
                failures.append(f"{rid_off}: outputs {sorted(files_on)} on, {sorted(files_off)} off")
            for key in sorted(set(files_on) & set(files_off)):
                same, why, diff = compare_arrays(f"{rid_off} {key}", np.load(files_on[key]), np.load(files_off[key]))
                compared += 1
                worst = max(worst, diff if diff == diff else 0.0)
                if not same:
                    failures.append(why)
        figures.update(outputs_compared=compared, outputs_max_abs_diff=round(worst, 5))
        if name == "capture" and not compared:
            failures.append("no captured rows to compare")
    if name in ("passthrough", "capture", "omni", "talker") and not figures.get("stopped_by_token"):
        failures.append("no request ended on a stop token: the case async scheduling runs once more went untested")
    return {"set": name, "ok": not failures, "failures": failures, "figures": figures}


def round_figures(name: str, res: dict) -> list[dict]:
    """An engine's timed rounds, in order: each round's decode time per token (the median of its
    requests', ms), when it started, its wall time in the engine's steps, and the engine steps (and,
    Llama sets, forwards) it took;
    [] for code2wav (a step per chunk, nothing to time) or a failed engine."""
    if not res.get("ok"):
        return []
    rounds = (res.get("bench") or {}).get("timed", []) if name == "talker" else res.get("rounds") or []
    return [{"decode_ms": round(1e3 * statistics.median(r["decode_s"]), 4) if r.get("decode_s") else None,
             "start_unix": r.get("start_unix"), "wall_s": round(r["wall_s"], 4) if r.get("wall_s") else None,
             "steps": r.get("steps"), "forwards": r.get("forwards")}
            for r in rounds]


def timing(name: str, on: dict, off: dict, tolerance: float) -> dict:
    """On against off over the rounds both ran: the per-round ratios, their median, min..max and
    bootstrap 95 % interval, the verdict (module docstring), and every round's figures."""
    a, b = round_figures(name, on), round_figures(name, off)
    pairs = [(x, y) for x, y in zip(a, b) if x["decode_ms"] and y["decode_ms"]]
    out: dict[str, Any] = {"on_rounds": a, "off_rounds": b, "rounds": len(pairs), "ratio": None, "verdict": "not measured"}
    if not pairs:  # code2wav: nothing to time; else an engine failed (its failure says so) or no round ran
        return out
    from parity import round_spread

    ratios = [round(x["decode_ms"] / y["decode_ms"], 4) for x, y in pairs]
    spread = round_spread(ratios)
    lo, hi = spread["ci95"]
    if len(pairs) < MIN_ROUNDS:
        verdict = "not resolved"
    elif hi <= 1 + tolerance:
        verdict = "on no worse than off"
    elif lo > 1 + tolerance:
        verdict = "on slower than off"
    else:
        verdict = "not resolved"
    first = ["on" if x["start_unix"] < y["start_unix"] else "off" for x, y in pairs
             if x["start_unix"] is not None and y["start_unix"] is not None]
    out.update(on_ms=round(statistics.median(x["decode_ms"] for x, _ in pairs), 4),
               off_ms=round(statistics.median(y["decode_ms"] for _, y in pairs), 4),
               ratio=spread["median"], min=spread["min"], max=spread["max"], ci95=spread["ci95"],
               round_ratios=ratios, first=first, verdict=verdict)
    return out


def report(results: dict[str, dict], sets: list[str], tolerance: float) -> dict:
    """Per set its results compared (pass or fail) and its timing (a verdict); all_ok: every set passed."""
    rows = []
    for s in sets:
        on, off = results.get(f"{s}-async-on", {}), results.get(f"{s}-async-off", {})
        row = compare_set(s, on, off)
        row["timing"] = timing(s, on, off, tolerance)
        rows.append(row)
    timed = [r["timing"]["verdict"] for r in rows if r["set"] in TIMED_SETS]
    return {"sets": rows, "all_ok": bool(rows) and all(r["ok"] for r in rows), "tolerance": tolerance,
            "timing_verdicts": {v: timed.count(v) for v in dict.fromkeys(timed)},
            "timing_is": f"decode time per token a client sees (each round: its requests' median), async "
                         f"on / off per round (rounds alternate on, off / off, on): median, min..max, bootstrap "
                         f"95 % interval; 'on no worse than off' when the interval's upper end <= {1 + tolerance:g}"}


def table(summary: dict) -> str:
    lines = ["| set | same results | stops | decode on ms | decode off ms | on/off (rounds: median; min..max; 95 % CI) "
             "| rounds | timing | results |", "|---|---|---|---|---|---|---|---|---|"]
    for r in summary["sets"]:
        t, f = r["timing"], r["figures"]
        ratio = (f"{t['ratio']:.3f}; {t['min']:.3f}..{t['max']:.3f}; {t['ci95'][0]:.3f}..{t['ci95'][1]:.3f}"
                 if t["ratio"] is not None else "-")
        lines.append(f"| {r['set']} | {f.get('identical_tokens', '-')} | {f.get('stopped_by_token', '-')} | "
                     f"{t.get('on_ms', '-')} | {t.get('off_ms', '-')} | {ratio} | {t['rounds']} | {t['verdict']} | "
                     f"{'PASS' if r['ok'] else 'FAIL'} |")
        lines += [f"    - {why}" for why in r["failures"]]
    return "\n".join(lines)


# -- the run -------------------------------------------------------------------------------------------


def run_all(args: argparse.Namespace, out: Path) -> dict[str, dict]:
    from acceptance import sidecar
    from tests.support.procs import run_engine, write_embeds
    from tests.tiny_models.llama import build_tiny_llama

    work = Path(tempfile.mkdtemp(prefix="omni-async-"))  # private: the sidecars' sockets live there
    llama = str(build_tiny_llama(work / "tiny-llama"))
    embeds_files = write_embeds(work, EMBEDS_LENS, 128)
    specs = engine_specs(args.sets)
    sidecars = {}
    deadline = time.monotonic() + args.limit_s
    rounds_until = time.time() + args.limit_s - REPORT_S  # no timed round starts later

    def one(spec: dict) -> dict:
        job = job_for(spec, args, llama, embeds_files, len(specs), rounds_until)
        try:
            return run_engine(job, work, spec["name"], timeout_s=max(30.0, deadline - time.monotonic()),
                              script=Path(spec["script"]))
        except Exception as exc:  # died or timed out: its log says how far it got
            return {"ok": False, "error": f"{type(exc).__name__}: {str(exc)[-1500:]}"}

    try:
        for spec in specs:
            sidecars[spec["name"]] = sc = sidecar(work, f"{spec['name']}-sidecar", spec["hooks"], args.gpu)
            spec["endpoint"] = sc.endpoint
        with ThreadPoolExecutor(len(specs)) as pool:
            futures = {s["name"]: pool.submit(one, s) for s in specs}
            results = {name: f.result() for name, f in futures.items()}
    finally:
        for sc in sidecars.values():
            sc.stop()
    logs = out / "logs"
    logs.mkdir(exist_ok=True)
    for f in work.glob("*.log"):
        logs.joinpath(f.name).write_text(f.read_text()[-20000:])
    return results


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="", help="where async-scheduling.json and the engines' logs go")
    ap.add_argument("--tts-model", default="", help="the tiny Qwen3-TTS checkpoint (python -m tests.tiny_models.qwen3_tts)")
    ap.add_argument("--sets", default=",".join(SETS), help=f"comma-separated, of {', '.join(SETS)}")
    ap.add_argument("--rounds", type=int, default=ROUNDS, help="timed rounds per engine")
    ap.add_argument("--tokens", type=int, default=TIMED_TOKENS,
                    help=f"tokens of each of the {TIMED_REQUESTS} requests of a timed round")
    ap.add_argument("--tolerance", type=float, default=0.05, help="on may be this much slower than off")
    ap.add_argument("--limit-s", type=float, default=300, help="the engines' wall time, start-up included")
    ap.add_argument("--gpu", default="0")
    ap.add_argument("--plan", action="store_true", help="print the engines it would start, run nothing")
    args = ap.parse_args(argv)
    args.sets = [s for s in args.sets.split(",") if s]
    unknown = [s for s in args.sets if s not in SETS]
    if unknown or not args.sets:
        ap.error(f"unknown set(s) {', '.join(unknown) or '(none given)'}; known: {', '.join(SETS)}")
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    if not 8 <= args.tokens <= MAX_TIMED_TOKENS:
        ap.error(f"--tokens must be 8..{MAX_TIMED_TOKENS}")
    if not args.plan and not args.out:
        ap.error("--out is required")
    if not args.plan and any(s in ("talker", "code2wav") for s in args.sets) and not args.tts_model:
        ap.error("the talker and code2wav sets need --tts-model")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.plan:
        print(json.dumps([{k: v for k, v in s.items() if k != "script"} for s in engine_specs(args.sets)], indent=1))
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    results = run_all(args, out)
    summary = report(results, args.sets, args.tolerance)
    from parity import run_commit, run_versions

    summary.update(versions=run_versions(), commit=run_commit(), wall_s=round(time.monotonic() - t0, 1),
                   rounds_asked=args.rounds, timed_requests=TIMED_REQUESTS, timed_tokens=args.tokens,
                   engines={name: {k: res.get(k) for k in ("ok", "error", "start_s", "async_scheduling",
                                                            "bench_rounds_cut")}
                            for name, res in results.items()})
    (out / "async-scheduling.json").write_text(json.dumps(summary, indent=1))
    print(table(summary))
    verdicts = ", ".join(f"{n} {v}" for v, n in summary["timing_verdicts"].items())
    print(f"results: ALL {'PASS' if summary['all_ok'] else 'FAIL'}; timing: {verdicts}; in {summary['wall_s']} s",
          flush=True)
    return 0 if summary["all_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
