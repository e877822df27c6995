"""Where each engine's step goes: py-spy samples of every engine core during the timed rounds.

`python -m bench.gpu --profile-s 40` samples each engine's processes (and the sidecar's) with py-spy
(`--nonblocking`: the engines are never paused) for the first seconds of the timed rounds, when
py-spy is on PATH, keeps the raw stacks beside the JSON and puts an attribution in it: per engine,
the samples under each phase of vLLM's step (and of the shim's link), per 100 samples of the work
the shim leaves alone (`NORMALIZERS`: vLLM's scheduling, its update from the step's output and its
sampling, the same work in every engine for the same rounds: the engines run alternating rounds, so
raw counts would compare their shares of the window, not their steps; these three together are
about a third of a step, so a few hundred samples and a few % of noise). What an engine adds over plain, converted to µs per step with plain's
median step period, is an estimate: py-spy leaves out time a thread is blocked (a futex, a device
wait where CUDA blocks rather than spins), which the step pace includes.

    python -m bench.gpu_profile [--plain-step-ms MS] PLAIN.txt SHIM.txt [INPROC.txt]   # saved raw stacks
"""

from __future__ import annotations

import argparse
import gzip
import math
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

NORMALIZERS = ("Scheduler.schedule", "Scheduler.update_from_output", "GPUModelRunner.sample_tokens")
# (label, frame): vLLM's step, then the shim's link (the in-process baseline runs the same link). py-spy
# names a frame by the class that defines the function: tests/test_bench_profile.py
# checks each shim frame against the code.
PHASES: tuple[tuple[str, str], ...] = (
    ("engine step", "EngineCore.step_with_batch_queue"),
    ("scheduler: schedule", "Scheduler.schedule"),
    ("scheduler: update from output", "Scheduler.update_from_output"),
    ("runner: execute_model", "GPUModelRunner.execute_model"),
    ("runner: prepare_inputs (vLLM)", "GPUModelRunner.prepare_inputs"),
    ("runner: add_requests", "GPUModelRunner.add_requests"),
    ("runner: piecewise graphs", "CudaGraphManager.run_pw_graph"),
    ("runner: sample_tokens", "GPUModelRunner.sample_tokens"),
    ("shim: step start", "SidecarLink.begin_step"),
    ("shim: StepBegin, sent early", "SidecarLink.ask_early"),
    ("shim: plan (wait, read)", "SidecarLink.pre_forward"),
    ("shim: waiting for the plan", "SidecarConnection.take_plan"),
    ("shim: plan read", "SidecarConnection.read_plan"),
    ("shim: embeds lookup", "EmbedsBuffer.fill"),
    ("shim: step end (StepEnd / StepTick)", "SidecarLink.end_step"),
    ("cycle collector callbacks (bench probe)", "GcProbe._collected"),
)
RATE_HZ = 250


def frame_name(frame: str) -> str:
    """`func (file.py:12)` -> `func` (py-spy's raw format names a frame by function, file and line)."""
    return frame.split(" (", 1)[0]


def load_stacks(paths: list[Path]) -> Counter:
    """Collapsed stacks (`a;b;c 12` per line) of one engine's processes, by their frames' names."""
    stacks: Counter = Counter()
    for path in paths:
        raw = Path(path).read_bytes()
        text = (gzip.decompress(raw) if raw[:2] == b"\x1f\x8b" else raw).decode(errors="replace")
        for line in text.splitlines():
            stack, _, count = line.rpartition(" ")
            if stack and count.isdigit():
                stacks[tuple(frame_name(f) for f in stack.split(";"))] += int(count)
    return stacks


def samples_under(stacks: Counter, *frames: str) -> int:
    """Samples whose stack holds any of `frames` (each sample counted once)."""
    return sum(n for stack, n in stacks.items() if any(f in stack for f in frames))


def attribute(stacks_by_engine: dict[str, Counter]) -> dict:
    """Per engine: its samples, and per phase the samples under it per 100 of the normalizers'."""
    engines = {}
    for engine, stacks in stacks_by_engine.items():
        base = samples_under(stacks, *NORMALIZERS)
        units = {label: round(100 * samples_under(stacks, frame) / base, 1) if base else None
                 for label, frame in PHASES}
        engines[engine] = {"samples": sum(stacks.values()), "normalizer_samples": base, "units": units}
    return {"normalizer": " + ".join(NORMALIZERS), "rate_hz": RATE_HZ, "engines": engines}


def render(profile: dict, plain_step_ms: float | None) -> list[str]:
    """A markdown table: phases x engines in normalizer units, and each engine's excess over plain
    as µs per step (estimated from plain's step period: units / plain's step units x its period)."""
    engines = profile.get("engines") or {}
    if "plain" not in engines or not engines["plain"].get("normalizer_samples"):
        return []
    others = [e for e in engines if e != "plain"]
    plain_units = engines["plain"]["units"]
    plain_step = plain_units.get("engine step") or 0
    head = "| phase | " + " | ".join(engines) + " | " + " | ".join(f"{e} - plain, µs / step (est.)" for e in others) + " |"
    lines = [head, "|---" * (1 + len(engines) + len(others)) + "|"]
    for label, _ in PHASES:
        cells = [engines[e]["units"].get(label) for e in engines]
        if not any(cells):
            continue
        extra = []
        for e in others:
            mine, theirs = engines[e]["units"].get(label), plain_units.get(label) or 0
            priced = plain_step and plain_step_ms and mine is not None  # None: no normalizing samples
            extra.append(f"{((mine or 0) - theirs) / plain_step * plain_step_ms * 1000:+.0f}" if priced else "-")
        lines.append(f"| {label} | " + " | ".join("-" if c is None else f"{c:g}" for c in cells) + " | "
                     + " | ".join(extra) + " |")
    samples = ", ".join(f"{e} {v['samples']} ({v['normalizer_samples']} normalizing)" for e, v in engines.items())
    lines += ["", f"Samples ({profile.get('rate_hz')} Hz, py-spy --nonblocking): {samples}."]
    return lines


class ProfileRecorder:
    """py-spy on each engine's processes (and the sidecar's) for `seconds`, raw stacks into `out`."""

    def __init__(self, exe: str, out: Path, config: str, seconds: float, idle: bool = False) -> None:
        self.exe, self.out, self.config, self.seconds = exe, out, config, seconds
        self.idle = idle  # also the samples of threads that wait (py-spy --idle): where a step blocks
        self.files: dict[str, list[Path]] = {}
        self.procs: list[subprocess.Popen] = []

    @classmethod
    def maybe(cls, out: Path, config: str, seconds: float, idle: bool = False) -> "ProfileRecorder | None":
        exe = shutil.which("py-spy") if seconds > 0 else None
        if seconds > 0 and exe is None:
            print("[profile] py-spy is not on PATH: no profile", flush=True)
        return cls(exe, out, config, seconds, idle) if exe else None

    def start(self, processes: dict[str, set[int]]) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        for name, pids in processes.items():
            if name == "driver":
                continue
            for pid in sorted(pids):
                path = self.out / f"prof-{self.config}-{name}-{pid}.txt"
                self.files.setdefault(name, []).append(path)
                try:
                    with open(path.with_suffix(".log"), "w") as log:  # a refused ptrace says so there
                        self.procs.append(subprocess.Popen(
                            [self.exe, "record", "--nonblocking", "-r", str(RATE_HZ), "-d",
                             str(math.ceil(self.seconds)), "--format", "raw", "-o", str(path), "-p", str(pid),
                             *(["--idle"] if self.idle else [])], stdout=log, stderr=subprocess.STDOUT))
                except OSError as exc:  # a profile less, not a failed configuration
                    print(f"[profile] py-spy on {name} ({pid}) did not start: {exc}", flush=True)

    def finish(self) -> dict:
        """Stop the samplers that still run (the timed rounds ended first: SIGINT, on which py-spy
        writes what it has), then attribute what they wrote."""
        self.stop()
        stacks = {name: load_stacks([p for p in paths if p.exists()]) for name, paths in self.files.items()}
        engines = {name: s for name, s in stacks.items() if name != "sidecar" and s}
        profile = attribute(engines)
        profile["files"] = sorted(p.name for paths in self.files.values() for p in paths if p.exists())
        profile["seconds"] = self.seconds
        profile["idle"] = self.idle
        return profile

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
        deadline = time.monotonic() + 30
        for proc in self.procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--plain-step-ms", type=float, help="plain's median step period (bench.gpu's step pace)")
    ap.add_argument("stacks", nargs="+", metavar="RAW", help="py-spy raw stacks: plain, shim[, inproc] (.gz too)")
    args = ap.parse_args(argv)
    if len(args.stacks) > 3:
        ap.error("at most three engines: plain, shim, inproc")
    names = ["plain", "shim", "inproc"]
    profile = attribute({names[i]: load_stacks([Path(p)]) for i, p in enumerate(args.stacks)})
    print("\n".join(render(profile, args.plain_step_ms)))


if __name__ == "__main__":
    main(sys.argv[1:])
