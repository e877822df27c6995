"""GPU check: vllm-omni's own Qwen3-TTS talker class on upstream V2 through
shim + sidecar gives the codes vllm-omni's own runner gives; and their decode step times.

Two engines, one process each (deploy/gpu/talker_engines.py), on the same tiny random
checkpoint (deploy/gpu/tiny_qwen3_tts.py), the same requests, greedy, CUDA graphs on:
  omni: vllm-omni 0.26's AR worker and runner (vLLM 0.26's V1 runner under it),
  shim: upstream vLLM 0.26 V2 + the shim + `omni-sidecar serve --hooks omni-talker`.
Checks: code 0 (the sampled tokens) and codes 1..Q-1 (the code predictor's, per decode
step) identical per request, including prompts longer than a step (chunked prefill);
the shim's blocking exchanges (one per step that brings new requests, none on decode
steps); FULL CUDA graphs captured. Figures: each engine's median decode step time over
a 16-request run and the shim's per-step host cost. Usage on the GPU host:

  PYTHONPATH=.:SITE python3 deploy/gpu/talker.py --model DIR --out OUT
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
ENGINE_TIMEOUT_S = 480  # one device call has 600 s for the install, both engines and this check
# Streaming requests take one text row per decode step; 70 text rows non-streaming make a
# 79-row prompt, over max_num_batched_tokens=64 (chunked prefill).
CODES = [dict(text_len=n, streaming=s, max_tokens=t, seed=i)
         for i, (n, s, t) in enumerate([(3, True, 24), (12, False, 40), (30, True, 32), (70, False, 20),
                                        (5, False, 48), (20, True, 36)])]
WARMUP = [dict(text_len=4, streaming=True, max_tokens=4, seed=90), dict(text_len=6, streaming=False, max_tokens=4,
                                                                        seed=91)]
BENCH = [dict(text_len=24, streaming=True, max_tokens=96, seed=100 + i) for i in range(16)]


def job(model: str, overrides: dict, quick: bool) -> dict:
    bench = [dict(b, max_tokens=12) for b in BENCH[:4]] if quick else BENCH
    codes = [dict(c, max_tokens=min(c["max_tokens"], 8)) for c in CODES] if quick else CODES
    return {"model": model, "max_num_seqs": 16, "max_num_batched_tokens": 64, "warmup": WARMUP, "codes": codes,
            "bench": bench, "engine_overrides": overrides}


def run(kind: str, spec: dict, work: Path, c: Check, gpus: str) -> dict:
    # vllm-omni's worker forces the V1 runner; the shim's engine is upstream's V2.
    env = {"CUDA_VISIBLE_DEVICES": gpus, "VLLM_USE_V2_MODEL_RUNNER": int(kind == "shim")}
    try:
        res = run_engine({**spec, "kind": kind, "env": env}, work, kind, timeout_s=ENGINE_TIMEOUT_S, script=ENGINES)
    except Exception as exc:  # died or timed out: its log says how far it got
        res = {"ok": False, "error": f"{type(exc).__name__}: {str(exc)[-2000:]}", "log_path": str(work / f"{kind}.log")}
    c.expect(res["ok"], f"{kind}: {res.get('error', '')}")
    if not res["ok"]:
        print(res.get("traceback", ""), flush=True)
        print(Path(res["log_path"]).read_text()[-4000:], flush=True)
    return res


def decode_step_ms(res: dict) -> float:
    """Median step time of the bench run, its first steps (prefill) left out."""
    steps = res["runs"]["bench"]["step_s"]
    return round(statistics.median(steps[2:] or steps) * 1e3, 3)


def compare(omni: dict, shim: dict, c: Check) -> None:
    a, b = omni["runs"]["codes"], shim["runs"]["codes"]
    same_tokens = sum(x == y and x is not None for x, y in zip(a["tokens"], b["tokens"]))
    same_codes = sum(x == y and x is not None for x, y in zip(a["codes"], b["codes"]))
    n = len(a["tokens"])
    c.figures.update(requests=n, same_code0=f"{same_tokens}/{n}", same_codes=f"{same_codes}/{n}",
                     code_rows=[len(x or []) for x in b["codes"]], omni_code_rows=[len(x or []) for x in a["codes"]])
    c.expect(same_tokens == n, "code 0 (sampled tokens) differs from vllm-omni's runner")
    c.expect(same_codes == n, "codes.audio differs from vllm-omni's runner")
    for toks, codes in zip(b["tokens"], b["codes"]):
        # Decode step k's row starts with the code 0 sampled at step k-1, except that vllm-omni's
        # talker_mtp writes 0 for a sampled id outside the codebook (a codec special, e.g. EOS).
        ok = bool(codes) and toks is not None and [r[0] for r in codes] == [
            t if 0 <= t < CODEBOOK else 0 for t in toks[: len(codes)]]
        c.expect(ok, "a sidecar codes.audio row does not start with the previous step's code 0")
        c.expect(bool(codes) and len(codes) == len(toks) - 1, "one codes row per decode step expected")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="a directory made by tiny_qwen3_tts.py")
    ap.add_argument("--out", default=tempfile.mkdtemp(prefix="omni-talker-"))
    ap.add_argument("--kinds", default="omni,shim")
    ap.add_argument("--engine-overrides", default="{}", help="JSON merged into both engines' arguments")
    ap.add_argument("--quick", action="store_true", help="short requests (a dry run)")
    ap.add_argument("--gpus", default="0")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    out.chmod(0o700)  # the sidecar's socket lives there
    spec = job(args.model, json.loads(args.engine_overrides), args.quick)
    kinds = args.kinds.split(",")
    spec["kinds"] = kinds
    c = Check("talker: vllm-omni's Qwen3TTSTalkerForConditionalGeneration, shim + sidecar on V2 == its own runner")
    results: dict = {}
    t0 = time.monotonic()
    sc = sidecar(out, "talker-sidecar", "omni-talker", args.gpus) if "shim" in kinds else None
    try:
        # Side by side on one GPU; their bench runs take turns (talker_engines.bench_turn).
        with ThreadPoolExecutor(len(kinds)) as pool:
            futures = {k: pool.submit(run, k, {**spec, "endpoint": sc.endpoint if sc else ""}, out, c, args.gpus)
                       for k in kinds}
            results.update({k: f.result() for k, f in futures.items()})
        if sc is not None:
            results["sidecar_status"] = _status(sc)
    finally:
        if sc is not None:
            sc.stop()
    omni, shim = results.get("omni", {}), results.get("shim", {})
    if omni.get("ok") and shim.get("ok"):
        compare(omni, shim, c)
    if shim.get("ok"):
        stats = shim["shim_stats"][0]
        log = Path(shim["log_path"]).read_text()
        new_steps = _steps_with_new_requests(spec)
        c.figures.update(shim_decode_step_ms=decode_step_ms(shim), steps=stats["steps"],
                         blocking_exchanges=stats["blocking_exchanges"], states_asked=stats.get("states_asked"),
                         exchange_us_p50=round(stats.get("exchange_us_p50", 0), 1),
                         post_us_p50=round(stats.get("post_us_p50", 0), 1),
                         post_us_p99=round(stats.get("post_us_p99", 0), 1),
                         model_hook_us_p50=round(stats.get("model_hook_us_p50", 0), 1),
                         shim_start_s=round(shim["start_s"], 1))
        c.expect("Using V2 Model Runner" in log, "the shim's engine did not use the V2 runner")
        c.expect(FULL_GRAPHS in log or "enforce_eager" in args.engine_overrides, "no FULL CUDA graphs captured")
        c.expect(stats["blocking_exchanges"] <= new_steps, "more blocking exchanges than steps with new requests")
    if omni.get("ok"):
        c.figures.update(omni_decode_step_ms=decode_step_ms(omni), omni_start_s=round(omni["start_s"], 1),
                         omni_steps=len(omni["runs"]["bench"]["step_s"]))
    for kind in ("omni", "shim"):
        if kind in results and Path(results[kind].get("log_path", "")).is_file():
            c.figures[f"{kind}_graphs"] = graph_captures(Path(results[kind]["log_path"]).read_text())
    if omni.get("ok") and shim.get("ok"):
        c.figures["step_ratio_shim_over_omni"] = round(decode_step_ms(shim) / decode_step_ms(omni), 3)
    c.figures["wall_s"] = round(time.monotonic() - t0, 1)
    summary = {"check": c.report(), "engines": {k: _brief(results[k]) for k in ("omni", "shim") if k in results},
               "sidecar_status": results.get("sidecar_status")}
    (out / "talker.json").write_text(json.dumps(summary, indent=1))


def graph_captures(log: str) -> list[str]:
    """What CUDA graphs the engine captured, as its log says ("Capturing CUDA graphs (...)")."""
    marker = "Capturing CUDA graphs"
    return sorted({line[line.index(marker):][:80] for line in log.splitlines() if marker in line})


def _steps_with_new_requests(spec: dict) -> int:
    """Upper bound: every request's first step may be its own (three runs, each request new once)."""
    return sum(len(spec[k]) for k in ("warmup", "codes", "bench"))


def _status(sc) -> dict:
    import msgspec

    return msgspec.to_builtins(sc.status())


def _brief(res: dict) -> dict:
    runs = res.get("runs", {})
    return {"ok": res.get("ok"), "error": res.get("error"), "traceback": res.get("traceback"),
            "start_s": res.get("start_s"), "codes": runs.get("codes"),
            "bench_step_s": runs.get("bench", {}).get("step_s"), "shim_stats": res.get("shim_stats")}


if __name__ == "__main__":
    main()
