"""bench/gpu_profile.py: py-spy's raw stacks read and attributed per phase (the bench's arithmetic)."""

from __future__ import annotations

from collections import Counter

from bench.gpu_profile import NORMALIZERS, attribute, load_stacks, render

STEP = "EngineCore.step_with_batch_queue"
SAMPLE = "GPUModelRunner.sample_tokens"
SCHED = "Scheduler.schedule"
GRAPHS = "CudaGraphManager.run_pw_graph"
PLAN = "SidecarLink.pre_forward"


def _write(path, lines):
    path.write_text("\n".join(lines) + "\n")
    return path


def test_raw_stacks_are_read_by_frame_name_and_summed_over_an_engines_processes(tmp_path):
    a = _write(tmp_path / "a.txt", [f"main (x.py:1);{STEP} (core.py:400);{SAMPLE} (runner.py:9) 7",
                                    f"main (x.py:1);{STEP} (core.py:400);{SCHED} (sched.py:2) 3", "garbage"])
    b = _write(tmp_path / "b.txt", [f"main (x.py:1);{STEP} (core.py:401);{SAMPLE} (runner.py:9) 2"])
    stacks = load_stacks([a, b])
    assert stacks[("main", STEP, SAMPLE)] == 9
    assert sum(stacks.values()) == 12


def test_phases_are_counted_per_100_normalizing_samples_and_the_excess_priced_by_plains_period():
    assert SAMPLE in NORMALIZERS and SCHED in NORMALIZERS
    plain = Counter({("s", STEP, SAMPLE): 10, ("s", STEP, SCHED): 40, ("s", STEP, GRAPHS): 50})
    # The shim engine got twice plain's share of the window: twice the samples everywhere, plus its plan.
    shim = Counter({("s", STEP, SAMPLE): 20, ("s", STEP, SCHED): 80, ("s", STEP, GRAPHS): 100, ("s", STEP, PLAN): 20})
    profile = attribute({"plain": plain, "shim": shim})
    units = {e: profile["engines"][e]["units"] for e in ("plain", "shim")}
    assert units["plain"]["engine step"] == 200.0 and units["shim"]["engine step"] == 220.0
    assert units["plain"]["runner: piecewise graphs"] == units["shim"]["runner: piecewise graphs"] == 100.0
    assert units["shim"]["shim: plan (wait, read)"] == 20.0
    table = "\n".join(render(profile, plain_step_ms=2.0))
    # 20 units over plain's 200-unit step of 2.0 ms: +200 µs a step, for the plan and the whole step alike.
    assert "| shim: plan (wait, read) | 0 | 20 | +200 |" in table
    assert "| engine step | 200 | 220 | +200 |" in table
    assert "| runner: piecewise graphs | 100 | 100 | +0 |" in table


def test_no_table_without_plains_normalizing_samples():
    assert render(attribute({"shim": Counter({("a",): 3})}), 2.0) == []


def test_the_report_shows_a_profiled_configurations_table_once_with_single_blank_lines():
    """bench/gpu_report.py renders each profiled configuration's attribution, priced by its plain step."""
    from bench.gpu_report import render as render_section

    plain = Counter({("s", STEP, SAMPLE): 10, ("s", STEP, GRAPHS): 10})
    shim = Counter({("s", STEP, SAMPLE): 10, ("s", STEP, GRAPHS): 10, ("s", STEP, PLAN): 5})
    profile = {**attribute({"plain": plain, "shim": shim}), "seconds": 40, "idle": True}
    config = {"config": "tiny-omni", "status": "done", "rounds": [], "profile": profile, "model": "tiny",
              "params_m": 0.39, "graphs": "PIECEWISE", "dtype": "bfloat16", "requests": 64, "max_tokens": 128,
              "pace": {"shim_vs_plain": {"plain_step_ms_median": 4.0}}}
    text = render_section({"machine": {}, "configs": [config]})
    assert text.count("Where each engine's step went, tiny-omni (`--profile-s 40 --profile-idle`") == 1
    # 50 units of plain's 200-unit step of 4 ms: +1000 µs a step.
    assert "| shim: plan (wait, read) | 0 | 50 | +1000 |" in text
    assert "\n\n\n" not in text


FAKE_PY_SPY = """#!{python}
import signal, sys, time
args = sys.argv
out = args[args.index("-o") + 1]
def write(count):
    with open(out, "w") as f:
        f.write("main (x.py:1);EngineCore.step_with_batch_queue (c.py:1);GPUModelRunner.sample_tokens (r.py:2) %d\\n" % count)
    sys.exit(0)
signal.signal(signal.SIGINT, lambda *_: write(7))  # stopped early: 7 samples
open(out + ".ready", "w").close()
time.sleep(float(args[args.index("-d") + 1]))
write(5)  # ran its whole duration: 5
"""


def test_the_recorder_stops_its_samplers_when_the_rounds_end_and_attributes_what_they_wrote(tmp_path):
    """A stand-in py-spy: the recorder starts one per engine process (not the driver), and `finish`
    interrupts those still running (py-spy writes its stacks on SIGINT) instead of waiting out -d."""
    import os
    import sys
    import time

    from bench.gpu_profile import ProfileRecorder

    exe = tmp_path / "py-spy"
    exe.write_text(FAKE_PY_SPY.format(python=sys.executable))
    exe.chmod(0o755)
    recorder = ProfileRecorder(str(exe), tmp_path / "out", "cfg", seconds=600)
    recorder.start({"driver": {os.getpid()}, "plain": {11}, "shim": {12, 13}})
    assert len(recorder.procs) == 3
    for path in [p for paths in recorder.files.values() for p in paths]:  # each sampler is up (its handler set)
        while not path.with_name(path.name + ".ready").exists():
            assert all(p.poll() is None for p in recorder.procs), "a stand-in sampler exited early"
            time.sleep(0.01)
    profile = recorder.finish()
    assert all(p.returncode == 0 for p in recorder.procs)
    assert profile["engines"]["plain"]["samples"] == 7 and profile["engines"]["shim"]["samples"] == 14
    assert profile["files"] == ["prof-cfg-plain-11.txt", "prof-cfg-shim-12.txt", "prof-cfg-shim-13.txt"]


def test_every_shim_phase_names_a_method_py_spy_would_see_in_our_code():
    """py-spy names a frame `Class.method` after the class whose body defines the method (a mixin's,
    not the class it is mixed into): a phase naming the link where a mixin defines the method counts
    nothing (session 15's first profile of the early ask read 0 for all three plan phases)."""
    import ast
    from pathlib import Path

    from bench.gpu_profile import PHASES

    root = Path(__file__).resolve().parents[1]
    defined = set()
    for package in ("worker_shim", "bench"):
        for path in (root / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ClassDef):
                    defined.update(f"{node.name}.{item.name}" for item in node.body
                                   if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)))
    ours = [(label, frame) for label, frame in PHASES if label.startswith("shim:") or "Probe" in frame]
    assert len(ours) >= 6
    missing = [(label, frame) for label, frame in ours if frame not in defined]
    assert not missing, missing
