"""Qwen3-Omni parity: vllm-omni 0.26's own pipeline (V1 runner) against ours (three V2 engines + the
shim + a sidecar per stage), on the same tiny checkpoint of the published layout and the same
requests: thinker tokens, talker codes, waveform, the vllm-omni patches in our engines, and time to
first audio and audio seconds per second at each concurrency.

Each pipeline runs in a process of its own (deploy/gpu/qwen3_omni_engines.py: its three engines,
the stages stepped in turn, vllm-omni's own non-streaming hand-overs); both start side by side on one
GPU, do the parity requests, then time their runs one after the other (vllm-omni's first).

The talker's code predictor (codebooks 1..15) samples at random in vllm-omni (top-k 50 / top-p 0.8
from the global random generator; no request or config setting reaches it), so both pipelines set
it greedy through its own `set_sampling_params` as the talker's model loads, before any CUDA graph
is captured (--code-predictor; worker_shim/omni_models/qwen3_omni/code_predictor.py). The report
says what each code predictor sampled with (`code_predictor_sampling`, read back after start) and
`first_divergence`, where each request's talker tokens and codes first differ.

  PYTHONPATH=.:SITE python3 deploy/gpu/qwen3_omni_parity.py --model DIR --out WORK --result OUT.json
  (--cpu --kinds shim: our pipeline alone on CPU, eager; bf16 as on the GPU: vllm-omni's talker keeps
  some of its weights in the checkpoint's dtype whatever the engine's)
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))

from tests.support.procs import SidecarProcess, run_engine  # noqa: E402
from tests.tiny_models.qwen3_omni import CODEC_IDS, NUM_CODE_GROUPS  # noqa: E402
from worker_shim.omni_models.qwen3_omni.code_predictor import CHOICES as CODE_PREDICTOR_CHOICES  # noqa: E402

ENGINES = HERE / "qwen3_omni_engines.py"
# Text requests of different lengths, and text + image ones: the same generated image (IMAGE) before
# their text, where the checkpoint has its multimodal processor files (built where torchvision is:
# tests/tiny_models/qwen3_omni.py), else reported as not run.
REQUESTS = [dict(rid=f"p{i}", text_len=n, seed=i) for i, n in enumerate((6, 17, 33, 50))]
IMAGE_REQUESTS = [dict(rid=f"i{i}", text_len=n, seed=10 + i, image=True) for i, n in enumerate((6, 33))]
# 64 x 32 pixels: a 2 x 4 grid of the tiny vision tower's 16-pixel patches, 2 image tokens once merged 2 x 2.
IMAGE = {"width": 64, "height": 32, "seed": 7}
MAX_TOKENS = {"thinker": 12, "talker": 40}
# The talker's parity requests return their top two logprobs per token (raw: before any processing,
# vLLM's default logprobs mode in both runners): where the pipelines' tokens differ, the report
# reads each one's margin between its two candidates (`talker_margins`).
TALKER_LOGPROBS = 2
SAMPLE_RATE = 24000  # vllm-omni's default for Qwen3-Omni's code2wav (metrics.definitions); the same for both
# bf16 (8 significant bits, compounded through the decoder): a waveform differs where the two
# runners order the same reductions differently. Bound: max abs diff <= this x the peak of vllm-omni's.
WAVE_RTOL = 0.05
CODE2WAV_DIRECT = {"frames": 30, "seed": 5}  # code2wav alone, the same random codes in both pipelines
# Where a pipeline failed, in the report: its traceback's last characters; for a process that died
# (a CUDA error aborts it in C++), its log's last lines, the abort's C++ frames left out and a
# kernel's assertion (printed by every thread that failed it) once.
REPORT_TRACEBACK_CHARS = 3000
LOG_TAIL_LINES = 40
CXX_FRAME = re.compile(r"^frame #\d+: ")
KERNEL_THREAD = re.compile(r"block: \[[^\]]*\], thread: \[[^\]]*\]")
SIDECARS = {"thinker": ("omni", []), "talker": ("omni-talker", []),
            "code2wav": ("omni-code2wav", [f"codebook_size={2048}"])}


def limits(max_num_seqs: int) -> dict:
    frames = MAX_TOKENS["talker"]
    return {"thinker": {"max_model_len": 256, "max_num_batched_tokens": 256},
            "talker": {"max_model_len": 256, "max_num_batched_tokens": 256},
            # vllm-omni's code2wav takes a request's whole codes in one prefill (Q x frames tokens). Its
            # scheduler (OmniGenerationScheduler) splits a waiting request's prompt at the step's token
            # budget even with chunked prefill off, and its model then decodes only the part it got: the
            # budget holds every request's whole codes, as its own deploy config's 65536 does.
            "code2wav": {"max_model_len": NUM_CODE_GROUPS * frames + 16,
                         "max_num_batched_tokens": max(NUM_CODE_GROUPS * frames + 16, 256) * max_num_seqs}}


def compare(omni: dict, shim: dict) -> dict:
    import numpy as np

    a, b = omni.get("parity") or {}, shim.get("parity") or {}
    rids = sorted(set(a) | set(b))
    n = len(rids)
    same_tokens = sum(a.get(r, {}).get("thinker_tokens") is not None
                      and a[r]["thinker_tokens"] == b.get(r, {}).get("thinker_tokens") for r in rids)
    same_codes = sum(a.get(r, {}).get("codes") is not None and a[r]["codes"] == b.get(r, {}).get("codes")
                     for r in rids)
    same_talker = sum(a.get(r, {}).get("talker_tokens") is not None
                      and a[r]["talker_tokens"] == b.get(r, {}).get("talker_tokens") for r in rids)
    waves: dict = {}
    for r in rids:
        x, y = a.get(r, {}).get("waveform"), b.get(r, {}).get("waveform")
        if x is None or y is None or len(x) != len(y):
            waves[r] = {"samples": [None if x is None else len(x), None if y is None else len(y)]}
            continue
        x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
        peak = float(np.max(np.abs(x))) if x.size else 0.0
        waves[r] = {"samples": int(x.size), "max_abs_diff": float(np.max(np.abs(x - y))) if x.size else 0.0,
                    "ref_peak": peak}
    x, y = ((r.get("code2wav_direct") or {}).get("waveform") for r in (omni, shim))
    direct = None
    if x is not None and y is not None and len(x) == len(y) and x:
        x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
        direct = {"samples": int(x.size), "max_abs_diff": float(np.max(np.abs(x - y))),
                  "ref_peak": float(np.max(np.abs(x)))}
    diffs = [w.get("max_abs_diff") for w in waves.values()]
    where = {r: {"talker_token": first_difference(a.get(r, {}).get("talker_tokens"), b.get(r, {}).get("talker_tokens")),
                 "code_frame": code_difference(a.get(r, {}).get("codes"), b.get(r, {}).get("codes"))} for r in rids}
    for r, w in where.items():
        if w["talker_token"] is not None:
            w["talker_logprobs"] = talker_margins(a.get(r, {}), b.get(r, {}), w["talker_token"])
    return {"thinker_tokens_identical": f"{same_tokens}/{n}", "talker_tokens_identical": f"{same_talker}/{n}",
            "talker_codes_identical": f"{same_codes}/{n}",
            "first_divergence": {r: w for r, w in where.items() if any(v is not None for v in w.values())},
            "waveform_max_abs_diff": max(diffs) if diffs and all(d is not None for d in diffs) else None,
            "waveforms": waves, "code2wav_same_codes": direct}


def first_difference(x: list | None, y: list | None) -> int | None:
    """The first index where two id lists differ (the shorter one's length where it is the other's
    start); None where they are equal or one is missing."""
    if x is None or y is None or x == y:
        return None
    return next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), min(len(x), len(y)))


def talker_margins(omni: dict, shim: dict, step: int) -> dict:
    """At the talker token where the pipelines first differ: each one's two best candidates, their
    logprobs and the margin between them; the largest difference between the two pipelines' logprobs
    of the same sampled token before that step (how far their numerics already stood apart); and a
    reading: a near tie (the same two candidates in swapped order, each margin within that difference)
    or a real difference."""
    out: dict = {"step": step}
    tops: dict[str, list] = {}
    for kind, rec in (("omni", omni), ("shim", shim)):
        steps = rec.get("talker_logprobs")
        if steps is None:
            out[kind] = "no logprobs: this pipeline's talker returned none"
        elif step >= len(steps):
            out[kind] = f"no logprobs at this step: its talker returned {len(steps)} tokens"
        elif len(steps[step]) < 2:
            out[kind] = f"fewer than two candidates at this step: {steps[step]}"
        else:
            (t1, l1), (t2, l2) = steps[step][:2]
            tops[kind] = [t1, t2]
            out[kind] = {"tokens": [t1, t2], "logprobs": [l1, l2], "margin": l1 - l2}
    a, b = omni.get("talker_logprobs"), shim.get("talker_logprobs")
    before = ([abs(x[0][1] - y[0][1]) for x, y in zip(a[:step], b[:step]) if x and y and x[0][0] == y[0][0]]
              if a is not None and b is not None else [])
    drift = max(before) if before else None
    out["same_token_logprob_diff_before"] = drift
    if len(tops) < 2:
        out["reading"] = "not read: a pipeline's logprobs are missing at this step"
        return out
    margins = f"margins {out['omni']['margin']:.4g} (vllm-omni) and {out['shim']['margin']:.4g} (ours)"
    if tops["omni"] != tops["shim"][::-1]:
        out["reading"] = f"a real difference: other candidates ({tops['omni']} vs ours {tops['shim']}), {margins}"
    elif drift is not None and max(out["omni"]["margin"], out["shim"]["margin"]) <= drift:
        out["reading"] = (f"near tie: the same two tokens in swapped order, {margins}, within the pipelines' "
                          f"logprob difference on the same tokens before it ({drift:.4g})")
    elif drift is None:
        out["reading"] = f"the same two tokens in swapped order, {margins}, at the first token (none before it to compare)"
    else:
        out["reading"] = (f"the same two tokens in swapped order, {margins}, beyond the pipelines' logprob "
                          f"difference on the same tokens before it ({drift:.4g})")
    return out


def code_difference(x: list | None, y: list | None) -> dict | None:
    """Where two requests' codes (codebook-major, flat: NUM_CODE_GROUPS rows of frames) first differ:
    the frame, the codebooks that differ in it, and each side's frame count; None where they are equal."""
    if x is None or y is None or x == y:
        return None
    q = NUM_CODE_GROUPS
    fx, fy = len(x) // q, len(y) // q
    frames = [[[c[k * f + i] for k in range(q)] for i in range(f)] for c, f in ((x, fx), (y, fy))]
    at = first_difference(*frames)
    books = ([] if at is None or at >= min(fx, fy)
             else [k for k in range(q) if frames[0][at][k] != frames[1][at][k]])
    return {"frame": at, "codebooks": books, "frames": [fx, fy]}


def figures(res: dict) -> dict:
    return {n: {k: v for k, v in run.items() if k != "errors"} | ({"errors": len(run["errors"])}
                                                                   if run.get("errors") else {})
            for n, run in (res.get("runs") or {}).items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="a directory made by tests/tiny_models/qwen3_omni.py")
    ap.add_argument("--out", required=True, help="work directory (sockets, logs)")
    ap.add_argument("--result", default="", help="write the summary here (docs/bench/gpu/qwen3-omni-parity.json)")
    ap.add_argument("--kinds", default="omni,shim")
    ap.add_argument("--concurrency", default="1,16")
    ap.add_argument("--limit-s", type=float, default=420, help="the whole run; each pipeline stops cleanly by then")
    ap.add_argument("--cpu", action="store_true", help="eager, no GPU (our pipeline only)")
    ap.add_argument("--eager", action="store_true",
                    help="on the GPU too: no torch.compile, no CUDA graphs (the engines start in seconds, not the "
                         "minutes compiling takes; the TTFA figures are then eager ones)")
    ap.add_argument("--gpus", default="0")
    ap.add_argument("--code-predictor", choices=CODE_PREDICTOR_CHOICES, default="greedy",
                    help="the talker's code predictor (codebooks 1..15) in both pipelines: greedy, or vllm-omni's own "
                         "top-k 50 / top-p 0.8 from the global random generator, which the two pipelines draw from "
                         "differently (worker_shim/omni_models/qwen3_omni/code_predictor.py)")
    args = ap.parse_args()
    t0 = time.monotonic()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    out.chmod(0o700)  # the sidecars' sockets live there
    kinds = args.kinds.split(",")
    concurrency = [int(n) for n in args.concurrency.split(",")]
    missing = processor_missing(args.model)
    images = missing is None
    env = {} if args.cpu else {"CUDA_VISIBLE_DEVICES": args.gpus}
    job = {"model": args.model, "requests": REQUESTS + (IMAGE_REQUESTS if images else []),
           "image": IMAGE if images else None, "max_tokens": MAX_TOKENS, "codec_eos": CODEC_IDS["codec_eos_token_id"],
           "talker_logprobs": TALKER_LOGPROBS,
           "concurrency": concurrency, "max_num_seqs": max(concurrency), "limits": limits(max(concurrency)),
           "dtype": "bfloat16", "enforce_eager": args.cpu or args.eager, "code_predictor": args.code_predictor,
           "kv_cache_memory_bytes": (64 << 20) if args.cpu else (1 << 30),
           "gpu_memory_utilization": None if args.cpu else round(0.8 / (3 * len(kinds)), 3),
           "sample_rate": SAMPLE_RATE, "code2wav_direct": CODE2WAV_DIRECT, "bench_order": [k for k in ("omni", "shim") if k in kinds],
           "limit_s": max(30.0, args.limit_s - (time.monotonic() - t0) - 30)}
    sidecars: dict[str, SidecarProcess] = {}
    results: dict = {}
    try:
        if "shim" in kinds:
            for stage, (hooks, options) in SIDECARS.items():
                sidecars[stage] = SidecarProcess(f"ipc://{out}/{stage}.sock", hooks, out / f"sidecar-{stage}.log",
                                                 options=options, env=env)
        endpoints = {stage: sc.endpoint for stage, sc in sidecars.items()}

        def one(kind: str) -> dict:
            run_env = {**env, "VLLM_USE_V2_MODEL_RUNNER": int(kind == "shim")}
            if kind == "shim":
                run_env["VLLM_PLUGINS"] = "omni_sidecar_shim"  # only the shim's plugin (vllm-omni's would patch)
            try:
                return run_engine({**job, "kind": kind, "env": run_env, "endpoints": endpoints}, out, kind,
                                  timeout_s=job["limit_s"] + 20, script=ENGINES)
            except Exception as exc:  # died or timed out: its log says how far it got, and where
                log = out / f"{kind}.log"
                return {"ok": False, "error": f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0]}",
                        "traceback": log_tail(log), "log_path": str(log)}

        with ThreadPoolExecutor(len(kinds)) as pool:
            results = dict(zip(kinds, pool.map(one, kinds)))
    finally:
        for sc in sidecars.values():
            sc.stop()
    report = summary(results, kinds, concurrency, args, missing)
    report["wall_s"] = round(time.monotonic() - t0, 1)
    (out / "qwen3-omni-report.json").write_text(json.dumps({"summary": report, "results": results}, default=str))
    if args.result:
        Path(args.result).write_text(json.dumps(report, indent=1) + "\n")
    print(table(report), flush=True)


def processor_missing(model: str) -> str | None:
    """Why the tiny checkpoint has no multimodal processor files (its builder says); None where it has them."""
    stamp = Path(model) / "omni_tiny.json"
    found = json.loads(stamp.read_text()) if stamp.is_file() else {}
    return None if found.get("processor") else found.get("processor_missing") or "its builder wrote none"


def summary(results: dict, kinds: list[str], concurrency: list[int], args: argparse.Namespace,
            processor_missing: str | None) -> dict:
    """The report; `processor_missing` None where the text + image requests ran, else why they did not."""
    from parity import run_commit, run_versions  # deploy/gpu/ is this script's folder

    omni, shim = results.get("omni", {}), results.get("shim", {})
    found = (shim.get("patches") or {})
    ours = sorted({*found.get("process", []), *[p for per in (found.get("workers") or {}).values()
                                                 for w in per for p in w]})
    report: dict = {}
    if "omni" in kinds and "shim" in kinds:
        report.update(compare(omni, shim))
    report["waveform_tolerance"] = f"max abs diff <= {WAVE_RTOL} x the peak of vllm-omni's waveform (bf16)"
    # What each pipeline's code predictor sampled codebooks 1..15 with (read back from vllm-omni's
    # wrapper): only greedy in effect in both makes identical codes an expectation.
    report["code_predictor_sampling"] = {kind: results.get(kind, {}).get("code_predictor") for kind in kinds}
    report["code_predictor_greedy_in_effect"] = all((s or {}).get("greedy_in_effect", False)
                                                    for s in report["code_predictor_sampling"].values())
    report["vllm_omni_patches_applied"] = ours if shim.get("patches") is not None else None
    report["vllm_omni_patches_found_in_its_own_pipeline"] = (omni.get("patches") or {}).get("process")
    report["ttfa_and_audio_rate"] = {kind: figures(results.get(kind, {})) for kind in kinds}
    report["pipelines"] = {kind: {"ok": results.get(kind, {}).get("ok"), "error": results.get(kind, {}).get("error"),
                                  "request_errors": results.get(kind, {}).get("errors"),
                                  "start_s": results.get(kind, {}).get("start_s"),
                                  "traceback": where_it_failed(results.get(kind, {}))}
                           for kind in kinds}
    report["talker_logprobs"] = (f"each pipeline's talker returns its top {TALKER_LOGPROBS} logprobs per token for the "
                                 "parity requests (SamplingParams logprobs; raw, before sampling): first_divergence's "
                                 "talker_logprobs reads them where the tokens differ")
    report["requests"] = {"text": [dict(r) for r in REQUESTS], "max_tokens": MAX_TOKENS,
                          "text_and_image": ({"requests": [dict(r) for r in IMAGE_REQUESTS], "image": IMAGE,
                                             "counted_in": "thinker_tokens_identical, talker_codes_identical"}
                                            if processor_missing is None else "not run: the tiny checkpoint has no multimodal processor "
                                                           f"files: {processor_missing}"),
                          "timed": "the text requests"}
    report["hand_overs"] = ("vllm-omni's non-streaming ones (async_chunk false): thinker2talker_full_payload, "
                            "talker2code2wav_full_payload, whole requests")
    report["versions"] = {**run_versions(), "cpu_only": args.cpu, "enforce_eager": args.cpu or args.eager}
    report["commit"] = run_commit()
    report["command"] = "sh deploy/gpu/run_qwen3_omni.sh BUNDLE OUT [LIMIT_S]"
    return report


def log_tail(path: Path) -> str | None:
    """A dead pipeline's log, its last lines that say where it failed."""
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return None
    kept: list[str] = []
    asserts: set[str] = set()
    for line in lines:
        if CXX_FRAME.match(line):
            continue
        if "Assertion" in line:
            kernel = KERNEL_THREAD.sub("", line)
            if kernel in asserts:
                continue
            asserts.add(kernel)
        kept.append(line)
    return "\n".join(kept[-LOG_TAIL_LINES:]) or None


def where_it_failed(result: dict) -> str | None:
    """The pipeline's traceback (or its log's tail), else its first failed request's."""
    found = result.get("traceback") or next(iter((result.get("request_tracebacks") or {}).values()), None)
    return found[-REPORT_TRACEBACK_CHARS:] if found else None


def table(report: dict) -> str:
    lines = []
    for key in ("thinker_tokens_identical", "talker_tokens_identical", "talker_codes_identical",
                "waveform_max_abs_diff", "vllm_omni_patches_applied", "code_predictor_greedy_in_effect",
                "first_divergence"):
        if key in report:
            lines.append(f"{key:32s} {report[key]}")
    for kind, sampling in report["code_predictor_sampling"].items():
        lines.append(f"{'code predictor ' + kind:32s} {sampling}")
    lines.append("| pipeline | requests | TTFA median (s) | TTFA max (s) | audio s / s | wall (s) |")
    lines.append("|---|---|---|---|---|---|")
    for kind, runs in report["ttfa_and_audio_rate"].items():
        for n, run in runs.items():
            lines.append(f"| {kind} | {n} | {run.get('ttfa_median_s', '–')} | {run.get('ttfa_max_s', '–')} | "
                         f"{run.get('audio_s_per_s', '–')} | {run.get('wall_s', run.get('skipped', '–'))} |")
    for kind, p in report["pipelines"].items():
        if not p["ok"]:
            lines.append(f"{kind}: {p['error'] or p['request_errors']}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
