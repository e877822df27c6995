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
    assert units["shim"]["shim: plan (StepBegin, wait, read)"] == 20.0
    table = "\n".join(render(profile, plain_step_ms=2.0))
    # 20 units over plain's 200-unit step of 2.0 ms: +200 µs a step, for the plan and the whole step alike.
    assert "| shim: plan (StepBegin, wait, read) | 0 | 20 | +200 |" in table
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
    assert "| shim: plan (StepBegin, wait, read) | 0 | 50 | +1000 |" in text
    assert "\n\n\n" not in text
