"""The one-device report of `python -m bench.gpu` (its section replaced each run).

The section lies between two marker comments; a run (also a partial one, after every
block) rewrites only what lies between them, or appends the section when the file has
none. Every figure comes from the results JSON, so `python -m bench.gpu --render-json
FILE` rebuilds the section from a run made elsewhere (the GPU host).
"""

from __future__ import annotations

import json
import os
import platform
import re
import subprocess
import sys
from pathlib import Path

from bench.gpu_profile import render as render_profile

BEGIN = "<!-- bench.gpu one-device: begin (written by `python -m bench.gpu`; edits here are replaced) -->"
END = "<!-- bench.gpu one-device: end -->"


def machine() -> dict:
    """Where and with what the run happened (no CUDA initialised here: engines fork after this)."""
    info: dict = {"python": platform.python_version(), "host_cpus": os.cpu_count(), "arch": platform.machine()}
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        gpus = [line.strip() for line in out.stdout.splitlines() if line.strip()]
        info["gpus"] = gpus
        info["visible_devices"] = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    except (OSError, subprocess.SubprocessError):
        info["gpus"] = []
    for mod in ("torch", "vllm", "msgspec", "zmq", "triton"):
        try:
            info[mod] = __import__(mod).__version__
        except Exception:
            info[mod] = None
    try:
        root = Path(__file__).resolve().parents[1]
        info["commit"] = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                                        text=True, timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        info["commit"] = None
    info["argv"] = " ".join(sys.argv[1:])
    return info


def _fmt_ci(ci) -> str:
    return f"{ci[0]:.3f} .. {ci[1]:.3f}" if ci else "-"


def render(res: dict) -> str:
    m = res.get("machine", {})
    gpu = ", ".join(m.get("gpus") or []) or "no GPU (CPU)"
    smoke = res.get("smoke")
    lines = [BEGIN, "", "## Decode throughput on one device, side by side", ""]
    if smoke:
        lines += ["**Smoke run on CPU** (`--smoke`: tiny sizes, float32, eager, 2 blocks): it proves the code path "
                  "end to end; its ratios are not figures to quote. The GPU run replaces this section.", ""]
    lines += [
        f"Run {res.get('date', '?')} on {gpu} ({m.get('host_cpus')} host CPUs), Python {m.get('python')}, "
        f"torch {m.get('torch')}, vLLM {m.get('vllm')} (Model Runner V2), msgspec {m.get('msgspec')}, "
        f"pyzmq {m.get('zmq')}; commit {m.get('commit')}; budget {res.get('budget_s')} s, used "
        f"{res.get('elapsed_s')} s{' (cut short)' if res.get('partial') else ''}. Raw rounds and machine: "
        f"`docs/bench/gpu/{res.get('json_name', 'gpu_ab.json')}`.",
        "",
    ]
    if res.get("runs"):  # several calls' runs rendered together (`--render-json A B`)
        lines += ["Runs merged into this section (each its own device call, same machine kind): " + "; ".join(
            f"{r['date']} commit {r['commit']} `{r['argv']}` ({r['elapsed_s']} s"
            + (f"; gives {', '.join(r['gives'])}" if r.get("gives") is not None else "") + ")"
            for r in res["runs"]) + ".", ""]
    lines += [
        "Method: one driver process holds both engines at once (each its own engine-core process, its own share "
        "of the device), then runs short rounds (N requests x T tokens, greedy, ignore_eos) alternating in ABBA / "
        "BAAB blocks. Ratio = median over blocks of (mean shim tok/s / mean plain tok/s in the block), with a "
        "bootstrap 95 % interval; spread = p10..p90 of block ratios, the two halves' medians (what two shorter "
        "runs would disagree by), each engine's round-to-round CV. Random-weight Llamas (`load_format=dummy`, "
        "fixed seed); `omni` = the omni hook set working every step (extra kwargs through a blocking plan, "
        "hidden states + 2 captured layers per token, prefill overlays), run with PIECEWISE graphs on both "
        "engines because the shim refuses extra kwargs under FULL graphs.",
        "",
        "| configuration | model | graphs | N x T | blocks | plain tok/s | shim tok/s | **shim / plain** (95 % CI) "
        "| block ratios p10..p90 | halves | CV plain / shim | shim steps, blocking | shim StepEnd p50 / exchange p50 "
        "(of which plan read) µs [the worker thread's CPU in the StepEnd record / the plan read]; kicks, shim sleeps |",
        "|---|---|---|---|---:|---:|---:|---|---|---|---|---|---|",
    ]
    for c in res.get("configs", []):
        s = c.get("summary") or {}
        st = c.get("shim_stats") or {}
        if c.get("status") in ("skipped", "failed") and not s.get("blocks"):
            lines.append(f"| {c['config']} | {c.get('model', '-')} | - | - | 0 | - | - | {c['status']}: "
                         f"{c.get('error', '')[:160]} | | | | | |")
            continue
        steps = f"{st.get('steps', '-')}, {st.get('blocking_exchanges', '-')}" if st else "-"
        # The worker thread's CPU time in the StepEnd record and the plan read, where recorded: the rest
        # of their wall time was waiting (the GIL, a core).
        cpu = (f" [cpu {st['step_end_cpu_us_p50']:.0f} / {st['plan_read_cpu_us_p50']:.0f}]"
               if st.get("step_end_cpu_us_n") or st.get("plan_read_cpu_us_n") else "")
        host = (f"{st.get('post_us_p50', 0):.0f} / {st.get('exchange_us_p50', 0):.0f} "
                f"({st.get('plan_read_us_p50', 0):.0f}){cpu}; {st.get('ring_counts_kicks', '-')}, "
                f"{st.get('ring_counts_sleeps', '-')}" if st else "-")
        status = "" if c.get("status") == "done" else f" ({c.get('status')})"
        lines.append(
            f"| {c['config']}{status} | {c['model']} ({c['params_m']} M) | {c['graphs']}, {c['dtype']} | "
            f"{c['requests']} x {c['max_tokens']} | {s.get('blocks', 0)} | {s.get('plain_tok_s_median', '-')} | "
            f"{s.get('shim_tok_s_median', '-')} | **{s.get('ratio_median', float('nan')):.3f}** "
            f"({_fmt_ci(s.get('ratio_ci95'))}) | {_fmt_ci(s.get('block_ratio_p10_p90'))} | "
            f"{s.get('halves')} | {s.get('cv_plain')} / {s.get('cv_shim')} | {steps} | {host} |")
    lines.append("")
    for c in res.get("configs", []):
        s = c.get("summary") or {}
        if s.get("verdict"):
            start = "engine starts " + " / ".join(f"{c[k]} s" for k in ("plain_start_s", "shim_start_s",
                                                                          "inproc_start_s") if k in c)
            if c.get("hooks") == "omni":
                got = c.get("kwargs_reached_model")
                start += (f"; extra kwargs reached the model's forward ({got['rows']} rows on its first such step)"
                          if got else "; extra kwargs did NOT reach the model's forward")
                if "kwargs_reached_model_inproc" in c:
                    start += (", in-process too" if c["kwargs_reached_model_inproc"] else
                              "; in-process, extra kwargs did NOT reach the model's forward")
            lines.append(f"- {c['config']}: {s['verdict']} ({start}).")
    lines += _boundary(res)
    lines += _pace(res)
    lines += _collector(res)
    lines += _profiles(res)
    ref = res.get("refusal")
    if ref:
        lines.append(f"- Extra kwargs under FULL CUDA graphs (the shim with `--hooks omni --hook-option extra_kwargs=1`, "
                     f"FULL_AND_PIECEWISE): {ref.get('status')}: `{ref.get('message') or ref.get('why', '')}`.")
    if res.get("exchange"):
        lines += ["", "Per-step exchange on this host (StepBegin for N requests -> StepPlan), µs p50 / p99:", "",
                  "| requests | shm ring | ZeroMQ only | raw pyzmq REQ/REP | ring / raw p50 |", "|---:|---:|---:|---:|---:|"]
        for r in res["exchange"]:
            lines.append(f"| {r['requests']} | {r['ring_p50']:.1f} / {r['ring_p99']:.1f} | {r['zmq_p50']:.1f} / "
                         f"{r['zmq_p99']:.1f} | {r['raw_p50']:.1f} / {r['raw_p99']:.1f} | {r['ratio_p50']:.2f} |")
    for h in res.get("handoff", []):
        lines.append(f"- handoff 16 MiB via {h['kind']}: shim host cost p50 {h['enqueue_us']['p50']:.0f} µs, "
                     f"until the sidecar has it p50 {h['round_trip_us']['p50']:.0f} µs")
    lines += ["", "Reproduce (one GPU): see `bench/gpu.py`'s docstring; the CPU smoke: "
              "`python -m bench.gpu --smoke`.", "", END]
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines))  # parts that end or begin with a blank line meet


def _boundary(res: dict) -> list[str]:
    """The price of the process boundary: the shim + sidecar against the same hook set called in
    the worker (bench/inproc.py), from the same alternating rounds as the table above."""
    rows = [c for c in res.get("configs", []) if (c.get("summary_boundary") or {}).get("blocks")]
    if not rows:
        return []
    lines = ["", "The process boundary: shim + sidecar vs the same hooks in-process (bench/inproc.py: the sidecar's "
             "session and hooks called in the vLLM worker, no socket, ring or arena copy). Per step: what an engine "
             "adds to each engine step's wall time over another (mean round time difference per step, median over "
             "blocks, bootstrap 95 % CI, the two halves); worker link time: the shim's `post_us` / `exchange_us` "
             "p50, i.e. the worker thread's time in end_step / the plan (in-process: the hooks themselves run "
             "there).", "",
             "| configuration | inproc tok/s | shim tok/s | **shim / inproc** (95 % CI) | block ratios p10..p90 | "
             "halves | inproc / plain (95 % CI) | **boundary µs / step** (95 % CI; halves) | inproc µs / step over "
             "plain | worker link p50 µs, inproc vs shim (end / plan) |", "|---|---:|---:|---|---|---|---|---|---|---|"]
    for c in rows:
        b, i = c["summary_boundary"], c.get("summary_inproc") or {}
        price = c.get("step_price") or {}
        sb, ip = price.get("shim_vs_inproc") or {}, price.get("inproc_vs_plain") or {}
        st_i, st_s = c.get("inproc_stats") or {}, c.get("shim_stats") or {}
        link = (f"{st_i.get('post_us_p50', 0):.0f} / {st_i.get('exchange_us_p50', 0):.0f} vs "
                f"{st_s.get('post_us_p50', 0):.0f} / {st_s.get('exchange_us_p50', 0):.0f}")
        lines.append(
            f"| {c['config']} | {b.get('inproc_tok_s_median', '-')} | {b.get('shim_tok_s_median', '-')} | "
            f"**{b['ratio_median']:.3f}** ({_fmt_ci(b.get('ratio_ci95'))}) | {_fmt_ci(b.get('block_ratio_p10_p90'))} "
            f"| {b.get('halves')} | {i.get('ratio_median', float('nan')):.3f} ({_fmt_ci(i.get('ratio_ci95'))}) | "
            f"**{sb.get('us_median', '-')}** ({sb.get('us_ci95')}; {sb.get('halves_us')}) | "
            f"{ip.get('us_median', '-')} ({ip.get('us_ci95')}) | {link} |")
    lines.append("")
    lines += [f"- {c['config']}: {c['summary_boundary']['verdict']}." for c in rows]
    return lines


PACE_PAIRS = (("shim_vs_plain", "shim / plain"), ("inproc_vs_plain", "inproc / plain"), ("shim_vs_inproc", "shim / inproc"))


def _pace(res: dict) -> list[str]:
    """The same rounds by their step pace: each round's median engine step period (the engine core's
    own output timestamps), so a burst of host steal that lengthens a few steps does not move it."""
    rows = [c for c in res.get("configs", []) if any((c.get("pace") or {}).get(k, {}).get("blocks")
                                                     for k, _ in PACE_PAIRS)]
    if not rows:
        return []
    lines = ["", "Step pace: the same rounds, each by its median engine step period (the gaps between the engine "
             "core's timestamps of its step outputs, vLLM's own `EngineCoreOutputs.timestamp`), ratio = the "
             "other engine's period / this one's per block (reads as throughput: below 1 is slower), median over "
             "blocks with a bootstrap 95 % CI and the two halves.", "",
             "| configuration | plain / shim / inproc step ms (median) | " +
             " | ".join(f"**{label}** (95 % CI; halves)" for _, label in PACE_PAIRS) + " |",
             "|---|---|" + "---|" * len(PACE_PAIRS)]
    for c in rows:
        pace = c["pace"]
        sp, ip = pace.get("shim_vs_plain") or {}, pace.get("inproc_vs_plain") or {}
        periods = " / ".join(str(x) for x in (sp.get("plain_step_ms_median", "-"), sp.get("shim_step_ms_median", "-"),
                                             ip.get("inproc_step_ms_median", "-")))
        cells = []
        for key, _ in PACE_PAIRS:
            s = pace.get(key) or {}
            cells.append(f"**{s['ratio_median']:.4f}** ({_fmt_ci(s.get('ratio_ci95'))}; {s.get('halves')})"
                         if s.get("blocks") else "-")
        lines.append(f"| {c['config']} | {periods} | " + " | ".join(cells) + " |")
    lines.append("")
    for c in rows:
        pins = c.get("pinning")
        if isinstance(pins, dict):
            lines.append(f"- {c['config']}: pinned " + ", ".join(f"{k} to CPUs {v['cpus']}" for k, v in pins.items())
                         + " (bench/pinning.py).")
        elif pins:
            lines.append(f"- {c['config']}: {pins}.")
        for key, label in PACE_PAIRS:
            s = (c["pace"].get(key) or {})
            if s.get("verdict"):
                lines.append(f"- {c['config']}, {label} by step pace: {s['verdict']}.")
    return lines


def _collector(res: dict) -> list[str]:
    """Python's cycle collector in each engine's process (bench/gpu_models.py, GcProbe), where recorded."""
    lines = []
    for c in res.get("configs", []):
        probes = {e: g for e, g in (c.get("gc") or {}).items() if g}
        if probes and "FULL" in str(c.get("graphs", "")):
            # The probe counts the model's Python forwards, and a FULL graph's replay runs none: its
            # "per step" would divide a whole run's collections by the warm-up's forwards.
            lines.append(f"- {c['config']}, the cycle collector: not priced per step under {c['graphs']} graphs "
                         "(a replay runs no Python forward; forwards counted: "
                         + ", ".join(f"{e} {g['forwards']}" for e, g in probes.items()) + ").")
        elif probes:
            lines.append(f"- {c['config']}, the cycle collector in each engine's process (its life, warm-up "
                         "included): " + "; ".join(
                             f"{e} {g['pause_us_per_forward']} µs a step (collections per 1000 steps by generation "
                             f"{' / '.join(str(n) for n in g['per_1000_forwards'])})" for e, g in probes.items()) + ".")
    return lines


def _profiles(res: dict) -> list[str]:
    """Where each engine's step went (bench/gpu_profile.py), where a run was profiled."""
    lines = []
    for c in res.get("configs", []):
        profile = c.get("profile") or {}
        plain_ms = ((c.get("pace") or {}).get("shim_vs_plain") or {}).get("plain_step_ms_median")
        table = render_profile(profile, plain_ms)
        if table:
            idle = " --profile-idle" if profile.get("idle") else ""
            lines += ["", f"Where each engine's step went, {c['config']} (`--profile-s {profile.get('seconds')}{idle}`: py-spy on "
                      f"every engine during the first timed rounds; samples under each phase per 100 under "
                      f"`{profile.get('normalizer')}`, work the shim leaves alone, the same in every engine; "
                      "µs estimated from plain's step period; " + ("waits included" if idle else "py-spy does not see blocked time")
                      + "; bench/gpu_profile.py):",
                      "", *table]
    return lines + [""] if lines else lines


def write_section(path: Path, section: str) -> None:
    """Replace the marked section of `path` (or append it), atomically."""
    path = Path(path)
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    if BEGIN in text and END in text:
        head, rest = text.split(BEGIN, 1)
        tail = rest.split(END, 1)[1]
        text = head + section + tail
    else:
        text = text.rstrip("\n") + "\n\n" + section + "\n"
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def write_json(path: Path, res: dict) -> None:
    tmp = Path(path).with_name(Path(path).name + ".tmp")
    tmp.write_text(json.dumps(res, indent=1))
    tmp.replace(path)
