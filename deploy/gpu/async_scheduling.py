"""Async scheduling on and off with every hook set, on one GPU (vLLM 0.26): the same results, and
the step time with it on no worse than with it off (docs/ARCHITECTURE.md, "Async scheduling").

  [ASYNC_LIMIT_S=330] sh deploy/gpu/run_async.sh BUNDLE_DIR OUT_DIR [options...]
  PYTHONPATH=.:/tmp/omni-site python3 deploy/gpu/async_scheduling.py --tts-model DIR --out OUT [options...]

Sets: `passthrough`, `capture`, `overlay` and `omni` on the tiny Llama (deploy/gpu/async_engines.py),
`talker` (the tiny Qwen3-TTS talker with its own hooks, `omni-talker`; talker_engines.py) and
`code2wav` (`omni-code2wav`; code2wav_engines.py), each run twice, async scheduling on and off,
every engine side by side on the GPU (their start-up is most of the wall time), each with a
sidecar of its own. Some requests carry stop token ids: the case async scheduling runs once more.

Per set, on against off: tokens (and finish reasons) identical; every output the sidecar kept the
same shape and, in bf16, close (captured rows, omni outputs; talker codes identical; the code2wav
waveform within 5% of its peak); at least one request ended on a stop token where the set has
stop tokens; each engine ran as asked (on / off). Timing: the Llama sets' ms per forward over
timed rounds, the talker's decode-step median, every engine's rounds in turn (talker_engines.Turns);
on / off <= 1 + `--tolerance`. Writes OUT/async-scheduling.json and prints a table.

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


def llama_requests(embeds_files: list[str] | None) -> list[dict]:
    import numpy as np

    if embeds_files is not None:  # the overlay set
        return [{"embeds_file": f, "max_tokens": 16} for f in embeds_files]
    rng = np.random.default_rng(1)
    return [{"token_ids": rng.integers(4, 380, n).tolist(), "max_tokens": 24,
             **({"stop_token_ids": LLAMA_STOPS} if i % 2 == 0 else {})} for i, n in enumerate(PROMPT_LENS)]


def engine_specs(sets: list[str]) -> list[dict]:
    """Two engines a set: async scheduling on, then off."""
    return [{"name": f"{s}-async-{mode}", "set": s, "async": mode == "on", "hooks": HOOKS[s],
             "script": str(SCRIPTS.get(s, HERE / "async_engines.py"))} for s in sets for mode in ("on", "off")]


def job_for(spec: dict, args: argparse.Namespace, llama: str, embeds_files: list[str], n_engines: int) -> dict:
    timed = [s for s in engine_specs(args.sets) if s["set"] != "code2wav"]
    bench = [{"name": "timed", "rounds": args.rounds, "temperature": 0.0,
              "reqs": [dict(text_len=16 + (i % 5) * 4, streaming=True, max_tokens=32, seed=100 + i) for i in range(4)]}]
    # vllm-omni is installed beside vLLM here: its plugin would patch every engine (the shim refuses that)
    env = {"CUDA_VISIBLE_DEVICES": args.gpu, "VLLM_USE_V2_MODEL_RUNNER": 1, "VLLM_PLUGINS": "omni_sidecar_shim"}
    common = {"endpoint": spec["endpoint"], "env": env, "engines": [s["name"] for s in timed],
              "barrier": [s["name"] for s in timed], "bench_sets": bench,
              "gpu_memory_utilization": round(0.8 / n_engines, 3)}
    if spec["set"] in LLAMA_SETS:
        return {**common, "kind": "shim", "model": llama, "async": spec["async"],
                "requests": llama_requests(embeds_files if spec["set"] == "overlay" else None)}
    tts = {**common, "kind": "shim", "model": args.tts_model, "engine_overrides": {"async_scheduling": spec["async"]},
           "shim_settings": {}, "profile": None, "max_num_seqs": 8, "max_num_batched_tokens": 64}
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


def step_ms(name: str, res: dict) -> float | None:
    """The set's step time: ms per forward over the timed rounds (Llama sets), the decode-step
    median (talker); None for code2wav (a step per chunk, nothing to time) or a failed engine."""
    if not res.get("ok"):
        return None
    if name == "talker":
        steps = [s for rounds in res.get("bench", {}).values() for r in rounds for s in r["decode_s"]]
        return 1e3 * statistics.median(steps) if steps else None
    rounds = res.get("rounds") or []
    return statistics.median(r["ms_per_step"] for r in rounds) if rounds else None


def timing(name: str, on: dict, off: dict, tolerance: float) -> dict:
    a, b = step_ms(name, on), step_ms(name, off)
    if a is None or b is None:  # code2wav: nothing to time; else an engine failed (its failure says so)
        return {"on_ms": a, "off_ms": b, "ratio": None, "ok": True}
    ratio = a / b
    return {"on_ms": round(a, 3), "off_ms": round(b, 3), "ratio": round(ratio, 3), "ok": ratio <= 1 + tolerance}


def report(results: dict[str, dict], sets: list[str], tolerance: float) -> dict:
    rows = []
    for s in sets:
        on, off = results.get(f"{s}-async-on", {}), results.get(f"{s}-async-off", {})
        row = compare_set(s, on, off)
        row["timing"] = timing(s, on, off, tolerance)
        if row["timing"]["ratio"] is None and s != "code2wav" and not row["failures"]:
            row["failures"].append("no step time measured")
            row["ok"] = False
        if not row["timing"]["ok"]:
            row["failures"].append(f"step with async scheduling on {row['timing']['on_ms']} ms, off "
                                   f"{row['timing']['off_ms']} ms: more than {tolerance:.0%} slower")
            row["ok"] = False
        rows.append(row)
    return {"sets": rows, "all_ok": bool(rows) and all(r["ok"] for r in rows), "tolerance": tolerance}


def table(summary: dict) -> str:
    lines = ["| set | same results | stops | step on ms | step off ms | on/off | ok |", "|---|---|---|---|---|---|---|"]
    for r in summary["sets"]:
        t, f = r["timing"], r["figures"]
        lines.append(f"| {r['set']} | {f.get('identical_tokens', '-')} | {f.get('stopped_by_token', '-')} | "
                     f"{t['on_ms'] if t['on_ms'] is not None else '-'} | {t['off_ms'] if t['off_ms'] is not None else '-'} | "
                     f"{t['ratio'] if t['ratio'] is not None else '-'} | {'PASS' if r['ok'] else 'FAIL'} |")
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

    def one(spec: dict) -> dict:
        job = job_for(spec, args, llama, embeds_files, len(specs))
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
    ap.add_argument("--rounds", type=int, default=3, help="timed rounds per engine")
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
    import torch

    summary.update(gpu=torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none",
                   torch=torch.__version__, wall_s=round(time.monotonic() - t0, 1),
                   engines={name: {k: res.get(k) for k in ("ok", "error", "start_s", "async_scheduling")}
                            for name, res in results.items()})
    (out / "async-scheduling.json").write_text(json.dumps(summary, indent=1))
    print(table(summary))
    print(f"ALL {'PASS' if summary['all_ok'] else 'FAIL'} in {summary['wall_s']} s", flush=True)
    return 0 if summary["all_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
