"""GPU benchmark on ONE device, plus the two-GPU host's exchange and handoff parts.

Default (`--parts throughput`): decode throughput shim / plain V2 and shim / in-process
baseline (the same hooks called in the worker, no sidecar: bench/inproc.py; the price of the
process boundary, in throughput and in µs per step) with all engines resident in this one
driver process (`--engines`), many short alternating rounds, median block ratios,
bootstrap 95 % intervals and the spread (bench/gpu_ab.py, bench/ab_stats.py), and Python's
cycle collector in each engine's process (collections and pause per step: bench/gpu_models.py,
`GcProbe`, plain's engine included), for
tiny-passthrough, tiny-omni, 1b-passthrough, 1b-omni (bench/gpu_models.py), in that
order, inside `--budget-s` (configurations that no longer fit are skipped, rounds stop at
the deadline, a watchdog ends the run GRACE_S past it). After every block it rewrites
`--out`/gpu_ab.json (machine, versions, every round, spread: the file BENCHMARKS.md's GPU tables
come from) and the rendered report `--benchmarks` (bench/gpu_report.py; default under .bench/, not
tracked: BENCHMARKS.md is edited by hand from it). `--parts exchange,handoff` add the per-step
exchange and 16 MiB handoff figures (to the JSON) when the budget still allows; `refusal`
(default) checks, in a thread while the first engines start, that the shim refuses
extra-kwargs hooks under FULL CUDA graphs at start-up with its one-line message. `--profile-s N`
samples every engine with py-spy (when on PATH) for the first N s of the timed rounds and says
where each engine's step went (bench/gpu_profile.py; raw stacks into `--raw`; those rounds run
beside the sampler; a bundle built with BUNDLE_PROFILER=1, or py-spy's wheel in .whl/, gives
run_bench.sh one).

On one GPU host with the bundle (deploy/gpu/build_bundle.sh) at .cache/h-gpu/bundle:
    sh deploy/gpu/run_bench.sh .cache/h-gpu/bundle OUT_DIR 470
or by hand, once installed into /tmp/omni-site:
    PYTHONPATH=$PWD:/tmp/omni-site VLLM_USE_V2_MODEL_RUNNER=1 VLLM_USE_FLASHINFER_SAMPLER=0 \
      HF_HUB_OFFLINE=1 python3 -m bench.gpu --budget-s 400 --out OUT_DIR
Here, on CPU (code path only; TRITON_INTERPRET=1 etc. as for the tests):
    python -m bench.gpu --smoke --out /tmp/smoke
Rebuild the report from a run made elsewhere: python -m bench.gpu --render-json OUT_DIR/gpu_ab.json
(several runs, one device call each, merge into one --out/gpu_ab.json: --render-json A/gpu_ab.json
B/gpu_ab.json). A device call holds ~10 minutes: the four configurations with three engines each do
not fit one, so the published figures merge two calls (`--configs tiny-omni,1b-omni --engines
plain,shim,inproc --parts throughput,refusal`, `--configs tiny-passthrough,1b-passthrough --engines
plain,shim --parts throughput,exchange`); the report lists each run it merged and what each gives.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.gpu_ab import CONFIGS, Budget, Sizes, run_all  # noqa: E402
from bench.gpu_report import machine, render as render_section, write_json, write_section  # noqa: E402

GRACE_S = 25.0  # past the budget, the watchdog ends the run (figures so far are on disk)


def render_two_gpu(res: dict, acceptance: list[tuple[str, list[dict]]]) -> str:
    """The two-GPU host's report, from one bench.gpu run (+ acceptance results)."""
    lines = [
        "## GPU, two devices",
        "",
        f"Machine: 2x {res['gpu']} host (32 cores), vLLM {res.get('vllm', '0.26.0')} (Model Runner V2, "
        f"FlashAttention 3, CUDA graphs FULL_AND_PIECEWISE), torch {res['torch']}, Python 3.12, bf16 tiny Llama.",
        "Reproduce: `PYTHONPATH=.:TARGET VLLM_USE_V2_MODEL_RUNNER=1 VLLM_USE_FLASHINFER_SAMPLER=0 "
        "python3 -m bench.gpu` (figures below, `docs/bench/gpu/bench.json`) and `python3 "
        "deploy/gpu/acceptance.py` (checks, `docs/bench/gpu/acceptance-*.json`).",
        "",
        "Per-step exchange (StepBegin for N requests -> StepPlan), µs:",
        "",
        "| requests | sidecar, shm ring p50 / p99 | sidecar, ZeroMQ only p50 / p99 | raw pyzmq REQ/REP p50 / p99 | ring / raw p50 |",
        "|---:|---:|---:|---:|---:|",
    ]
    for r in res.get("exchange", []):
        lines.append(f"| {r['requests']} | {r['ring_p50']:.1f} / {r['ring_p99']:.1f} | {r['zmq_p50']:.1f} / "
                     f"{r['zmq_p99']:.1f} | {r['raw_p50']:.1f} / {r['raw_p99']:.1f} | {r['ratio_p50']:.2f} |")
    lines += ["", "Tensor handoff, 16 MiB of bf16 hidden states, shim -> sidecar (two processes), µs:", "",
              "| path | shim host cost p50 / p99 | until the sidecar has the bytes p50 / p99 | opens (consumer, producer) |",
              "|---|---:|---:|---|"]
    for h in res.get("handoff", []):
        name = "CUDA IPC arena (opened once, event ring)" if h["kind"] == "cuda_ipc" else "host staging (shm)"
        lines.append(f"| {name} | {h['enqueue_us']['p50']:.0f} / {h['enqueue_us']['p99']:.0f} | "
                     f"{h['round_trip_us']['p50']:.0f} / {h['round_trip_us']['p99']:.0f} | "
                     f"{h['consumer_opens']}, {h['producer_opens']} |")
    lines += ["", "Decode throughput, shim + pass-through sidecar vs plain V2 (64 requests x 256 tokens, the two "
              "engines side by side on GPU 0 and 1, then swapped; ratio = mean over the two pairs of "
              "median shim / median plain):", "",
              "| step channel | plain tok/s | shim tok/s | pair ratios | shim / plain |", "|---|---|---|---|---:|"]
    for t in res.get("throughput", []):
        lines.append(f"| {t['variant']} | {t['plain_tok_s']} | {t['shim_tok_s']} | {t['pair_ratios']} | "
                     f"**{t['ratio']:.3f}** |")
    for source, results in acceptance:
        lines += ["", f"Acceptance checks on the same host (`deploy/gpu/acceptance.py`, `{source}`):", ""]
        for a in results:
            figs = {k: v for k, v in a["figures"].items() if not k.endswith("tok_s") and k != "ratio"}
            lines.append(f"- {'PASS' if a['ok'] else 'FAIL'} {a['name']}: `{json.dumps(figs)}`")
    lines += ["", "Notes: the tiny model (2.5-8 ms per step) makes the shim's per-step host cost as visible as "
              "it gets; plain throughput differs between the two GPUs and runs by up to 30 %, so only "
              "side-by-side pairs are compared. The handoff's host cost is the shim's per-step enqueue "
              "(copy launch, event record, message); nothing waits for the GPU.", ""]
    return "\n".join(lines)


def _watchdog(seconds: float) -> threading.Timer:
    """Ends this process and the processes it started (engine cores, sidecars) if the run overstays."""
    def stop() -> None:
        print(f"bench.gpu: past the budget by {GRACE_S:.0f} s: stopping (figures so far are written)", flush=True)
        try:
            import psutil

            for child in psutil.Process().children(recursive=True):
                child.kill()
        except Exception:
            pass
        os._exit(3)

    timer = threading.Timer(seconds, stop)
    timer.daemon = True
    timer.start()
    return timer


def merge_runs(runs: list[dict]) -> dict:
    """Several runs' configurations in one result (the first run's machine and name); each run's date,
    commit and command line kept under `runs`."""
    if len(runs) == 1:
        return runs[0]
    parts = ("refusal", "exchange", "handoff")  # each from the first run that has it
    res = dict({k: v for k, v in runs[0].items() if k not in parts}, configs=[], runs=[])
    for run in runs:
        res["configs"] += run.get("configs", [])
        # What this run gives the section: a run's command may name more than a derived JSON kept of it.
        gives = [c.get("config", "?") for c in run.get("configs", [])]
        for key in parts:
            if run.get(key) and not res.get(key):
                res[key] = run[key]
                gives.append(key)
        res["runs"].append({"date": run.get("date"), "commit": run.get("machine", {}).get("commit"),
                            "argv": run.get("machine", {}).get("argv"), "elapsed_s": run.get("elapsed_s"),
                            "gives": gives})
    res["partial"] = any(r.get("partial") for r in runs)
    res["elapsed_s"] = round(sum(r.get("elapsed_s") or 0 for r in runs), 1)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="CPU code-path check: tiny sizes, float32, eager, 2 blocks")
    ap.add_argument("--budget-s", type=float, default=400.0, help="bound on the whole run (partial results stay)")
    ap.add_argument("--configs", default=",".join(CONFIGS), help=f"in order, from {', '.join(CONFIGS)}")
    ap.add_argument("--engines", default="plain,shim,inproc",
                    help="engines per configuration, plain first: plain,shim[,inproc] (inproc: the in-process baseline)")
    ap.add_argument("--measure-s", type=float, help="seconds of timed rounds per configuration (default 22; smoke: 2 blocks)")
    ap.add_argument("--pin", action="store_true",
                    help="each engine and the sidecar on cores of their own (bench/pinning.py says why it is off)")
    ap.add_argument("--profile-s", type=float, default=0.0,
                    help="py-spy (when on PATH) on every engine for the timed rounds' first seconds: raw stacks "
                         "into --raw, each phase's share of the step in the JSON and the report (bench/gpu_profile.py)")
    ap.add_argument("--profile-idle", action="store_true",
                    help="with --profile-s: sample waiting threads too (py-spy --idle): where a step blocks")
    ap.add_argument("--parts", default="throughput,refusal", help="throughput[,refusal][,exchange][,handoff]")
    ap.add_argument("--iters", type=int, default=500, help="exchange round trips per block (--parts exchange)")
    ap.add_argument("--out", default=str(ROOT / "docs" / "bench" / "gpu"), help="folder for the JSON")
    ap.add_argument("--raw", default=str(ROOT / ".bench" / "gpu"), help="folder for raw output (profiles)")
    ap.add_argument("--benchmarks", default=str(ROOT / ".bench" / "gpu" / "report.md"),
                    help="markdown file whose bench.gpu section is replaced ('' to leave it)")
    ap.add_argument("--render-json", nargs="+", metavar="JSON",
                    help="rebuild the report's section from a run's JSON, exit; several runs (one device call "
                         "each) are merged into --out/gpu_ab.json first")
    ap.add_argument("--render", nargs="+", metavar="JSON",
                    help="the two-GPU host's report (--markdown) from its results, exit")
    ap.add_argument("--markdown", default=str(ROOT / ".bench" / "gpu" / "two-gpu.md"))
    args = ap.parse_args()
    if args.render:
        res = json.loads(Path(args.render[0]).read_text())
        acc = [(Path(f).name, json.loads(Path(f).read_text())["results"]) for f in args.render[1:]]
        Path(args.markdown).parent.mkdir(parents=True, exist_ok=True)
        Path(args.markdown).write_text(render_two_gpu(res, acc))
        print(f"written {args.markdown}")
        return
    if args.benchmarks:
        Path(args.benchmarks).parent.mkdir(parents=True, exist_ok=True)
    if args.render_json:
        res = merge_runs([json.loads(Path(f).read_text()) for f in args.render_json])
        if len(args.render_json) > 1:
            Path(args.out).mkdir(parents=True, exist_ok=True)
            write_json(Path(args.out) / res["json_name"], res)
        write_section(Path(args.benchmarks), render_section(res))
        print(f"written {args.benchmarks}")
        return
    budget = Budget(args.budget_s)
    _watchdog(args.budget_s + GRACE_S)
    sizes = Sizes.smoke_sizes() if args.smoke else Sizes()
    if args.measure_s is not None:
        sizes.measure_s = args.measure_s
    engines = tuple(e for e in args.engines.split(",") if e)
    if engines not in (("plain", "shim"), ("plain", "shim", "inproc")):
        raise SystemExit(f"--engines {args.engines!r}: plain,shim or plain,shim,inproc")
    sizes.engines = engines
    sizes.pin = args.pin
    sizes.profile_s, sizes.profile_dir, sizes.profile_idle = args.profile_s, args.raw, args.profile_idle
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    json_path = out / ("gpu_ab-smoke.json" if args.smoke else "gpu_ab.json")
    work = Path(tempfile.mkdtemp(prefix="omni-gpu-ab-"))
    res: dict = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "smoke": args.smoke,
                 "budget_s": args.budget_s, "json_name": json_path.name, "machine": machine(),
                 "sizes": {k: v for k, v in vars(sizes).items()}, "configs": [], "partial": True}

    def sink(configs: list[dict]) -> None:
        res["configs"] = configs
        res["elapsed_s"] = round(budget.elapsed(), 1)
        write_json(json_path, res)
        if args.benchmarks:
            write_section(Path(args.benchmarks), render_section(res))

    parts = args.parts.split(",")
    from bench.gpu_models import install_plugin

    install_plugin(work)
    refusal, held = None, {}
    if "refusal" in parts:  # alongside the first engines' start (it fails before any model loads)
        from bench.gpu_refusal import refusal_check

        # Its own holder: `res` is being serialised by sink() meanwhile.
        def check() -> None:
            try:
                held["refusal"] = refusal_check(work, sizes)
            except Exception as exc:
                held["refusal"] = {"status": "check failed", "message": f"{type(exc).__name__}: {exc}"[:400]}

        refusal = threading.Thread(target=check, daemon=True)
        refusal.start()
    if "throughput" in parts:
        names = [n for n in args.configs.split(",") if n]
        unknown = [n for n in names if n not in CONFIGS]
        if unknown:
            raise SystemExit(f"unknown configuration(s) {unknown}; known: {list(CONFIGS)}")
        run_all(names, work, sizes, budget, sink)
    if refusal is not None:
        refusal.join(max(1.0, budget.left()))
        res["refusal"] = held.get("refusal", {"status": "unfinished within the budget"})
    if "exchange" in parts and budget.left() > 60:
        from bench.__main__ import exchange

        res["exchange"], _ = exchange(work, args.iters)
    if "handoff" in parts and budget.left() > 40:
        from bench.gpu_handoff import run as handoff_run

        res["handoff"] = [handoff_run("cuda_ipc", 16, 300), handoff_run("shm", 16, 100)]
    res["partial"] = any(c.get("status") != "done" for c in res["configs"])
    sink(res["configs"])
    print(f"written {json_path}" + (f" and {args.benchmarks}" if args.benchmarks else ""), flush=True)
    sys.stdout.flush()
    os._exit(0)  # engines are shut down; skip the interpreter's slow teardown


if __name__ == "__main__":
    main()
