"""bench/gpu_profile.py: py-spy's raw stacks read and attributed per phase (the bench's arithmetic)."""

from __future__ import annotations

from collections import Counter

from bench.gpu_profile import NORMALIZER, attribute, load_stacks, render

STEP = "EngineCore.step_with_batch_queue (vllm/v1/engine/core.py:400)"
SAMPLE = "GPUModelRunner.sample (vllm/v1/worker/gpu/model_runner.py:900)"
PLAN = "SidecarLink.pre_forward (worker_shim/link.py:160)"
SCHED = "Scheduler.schedule (vllm/v1/core/sched/scheduler.py:200)"


def _write(path, lines):
    path.write_text("\n".join(lines) + "\n")
    return path


def test_raw_stacks_are_read_by_frame_name_and_summed_over_an_engines_processes(tmp_path):
    a = _write(tmp_path / "a.txt", [f"main (x.py:1);{STEP};{SAMPLE} 7", f"main (x.py:1);{STEP};{SCHED} 3", "garbage"])
    b = _write(tmp_path / "b.txt", [f"main (x.py:1);{STEP};{SAMPLE} 2"])
    stacks = load_stacks([a, b])
    assert stacks[("main", "EngineCore.step_with_batch_queue", NORMALIZER)] == 9
    assert sum(stacks.values()) == 12


def test_phases_are_counted_per_100_sampler_samples_and_the_excess_priced_by_plains_period():
    plain = Counter({("s", "EngineCore.step_with_batch_queue", NORMALIZER): 10,
                     ("s", "EngineCore.step_with_batch_queue", "Scheduler.schedule"): 40})
    # The shim engine got twice plain's share of the window: twice the samples everywhere, plus its plan.
    shim = Counter({("s", "EngineCore.step_with_batch_queue", NORMALIZER): 20,
                    ("s", "EngineCore.step_with_batch_queue", "Scheduler.schedule"): 80,
                    ("s", "EngineCore.step_with_batch_queue", "SidecarLink.pre_forward"): 20})
    profile = attribute({"plain": plain, "shim": shim})
    units = {e: profile["engines"][e]["units"] for e in ("plain", "shim")}
    assert units["plain"]["engine step"] == 500.0 and units["shim"]["engine step"] == 600.0
    assert units["plain"]["scheduler: schedule"] == units["shim"]["scheduler: schedule"] == 400.0
    assert units["shim"]["shim: plan (StepBegin, wait, read)"] == 100.0
    table = "\n".join(render(profile, plain_step_ms=2.0))
    # 100 units over plain's 500-unit step of 2.0 ms: +400 µs a step, for the plan and the whole step alike.
    assert "| shim: plan (StepBegin, wait, read) | 0 | 100 | +400 |" in table
    assert "| engine step | 500 | 600 | +200 |" not in table and "| engine step | 500 | 600 | +400 |" in table
    assert "| scheduler: schedule | 400 | 400 | +0 |" in table


def test_no_table_without_plains_sampler_samples():
    assert render(attribute({"shim": Counter({("a",): 3})}), 2.0) == []
