"""The one-device bench's statistics and its BENCHMARKS.md section (pure functions: no timing)."""

from __future__ import annotations

from bench.ab_stats import block_order, block_ratios, bootstrap_median, step_pace, step_price, summarize
from bench.gpu_report import BEGIN, END, render, write_section


def rounds(plain: list[float], shim: list[float]) -> list[dict]:
    """Blocks of two plain and two shim rounds, in the bench's order."""
    out, p, s = [], iter(plain), iter(shim)
    for b in range(len(plain) // 2):
        for engine in block_order(b):
            out.append({"block": b, "engine": engine, "tok_s": next(p if engine == "plain" else s), "s": 1.0})
    return out


def test_blocks_alternate_abba_and_baab():
    assert block_order(0) == ["plain", "shim", "shim", "plain"]
    assert block_order(1) == ["shim", "plain", "plain", "shim"]


def test_block_ratio_is_mean_shim_over_mean_plain_and_skips_incomplete_blocks():
    rs = rounds([100, 100, 200, 200], [90, 110, 180, 180])
    assert block_ratios(rs) == [1.0, 0.9]
    assert block_ratios(rs[:-1]) == [1.0]  # the last block lost its last round


def test_bootstrap_interval_holds_the_median_and_is_seeded():
    values = [0.97, 0.98, 0.99, 1.0, 0.985, 0.975, 0.995]
    lo, hi = bootstrap_median(values)
    assert lo <= sorted(values)[3] <= hi
    assert bootstrap_median(values) == (lo, hi)


def test_an_effect_inside_the_spread_is_not_claimed():
    plain = [100.0, 104.0, 96.0, 101.0, 99.0, 103.0, 97.0, 100.0, 102.0, 98.0, 100.0, 101.0, 99.0, 100.0]
    same = summarize(rounds(plain, list(reversed(plain))))
    assert same["blocks"] == 7 and same["ratio_ci95"][0] <= 1.0 <= same["ratio_ci95"][1]
    assert "not" in same["verdict"].split(":")[-1] or "no cost" in same["verdict"]
    slower = summarize(rounds(plain, [x * 0.9 for x in plain]))
    assert abs(slower["ratio_median"] - 0.9) < 1e-3 and slower["verdict"].endswith("agree within the effect")
    few = summarize(rounds(plain[:4], [x * 0.9 for x in plain[:4]]))
    assert "only 2 blocks" in few["verdict"]


def test_the_section_is_replaced_not_appended(tmp_path):
    path = tmp_path / "BENCHMARKS.md"
    path.write_text("# Benchmarks\n\nkept above\n")
    res = {"smoke": True, "machine": {}, "configs": [
        {"config": "tiny-passthrough", "model": "tiny", "params_m": 0.39, "graphs": "eager", "dtype": "float32",
         "requests": 4, "max_tokens": 8, "status": "done", "summary": summarize(rounds([10.0] * 4, [9.0] * 4))},
        {"config": "1b-omni", "status": "skipped", "error": "budget"}]}
    write_section(path, render(res))
    path.write_text(path.read_text() + "\nkept below\n")
    write_section(path, render(res))
    text = path.read_text()
    assert text.count(BEGIN) == 1 and text.count(END) == 1
    assert text.startswith("# Benchmarks\n\nkept above\n") and text.rstrip().endswith("kept below")
    assert "**0.900**" in text and "1b-omni | - | - | - | 0 | - | - | skipped: budget" in text


def test_three_engines_run_in_palindromes_so_every_pair_is_balanced():
    engines = ("plain", "shim", "inproc")
    assert block_order(0, engines) == ["plain", "shim", "inproc", "inproc", "shim", "plain"]
    assert block_order(1, engines) == ["shim", "inproc", "plain", "plain", "inproc", "shim"]
    assert block_order(2, engines) == ["inproc", "plain", "shim", "shim", "plain", "inproc"]
    for b in range(3):  # each engine's two rounds sit symmetrically about the block's middle
        order = block_order(b, engines)
        assert all(sum(i for i, e in enumerate(order) if e == name) == 5 for name in engines)


def test_pairs_and_the_price_per_step():
    """Three engines; shim rounds take 1.1 s, in-process 1.0 s, plain 0.9 s, 100 steps a round."""
    secs = {"plain": 0.9, "shim": 1.1, "inproc": 1.0}
    rs = [{"block": b, "engine": e, "tokens": 900, "s": secs[e], "tok_s": 900 / secs[e]}
          for b in range(6) for e in block_order(b, tuple(secs))]
    boundary = summarize(rs, "shim", "inproc")
    assert abs(boundary["ratio_median"] - 1.0 / 1.1) < 1e-3 and boundary["blocks"] == 6
    assert "inproc_tok_s_median" in boundary and boundary["verdict"].startswith("shim costs")
    price = step_price(rs, "shim", "inproc", 100)
    assert price["us_median"] == 1000.0 and price["us_ci95"] == [1000.0, 1000.0]
    assert step_price(rs, "shim", "inproc", 0) == {"blocks": 0}


def test_the_section_shows_the_boundary_when_the_baseline_ran(tmp_path):
    secs = {"plain": 0.9, "shim": 1.1, "inproc": 1.0}
    rs = [{"block": b, "engine": e, "tokens": 900, "s": secs[e], "tok_s": 900 / secs[e]}
          for b in range(6) for e in block_order(b, tuple(secs))]
    conf = {"config": "tiny-omni", "model": "tiny", "params_m": 0.39, "graphs": "eager", "dtype": "float32",
            "requests": 4, "max_tokens": 8, "status": "done", "summary": summarize(rs),
            "summary_inproc": summarize(rs, "inproc", "plain"), "summary_boundary": summarize(rs, "shim", "inproc"),
            "step_price": {"shim_vs_inproc": step_price(rs, "shim", "inproc", 100),
                           "inproc_vs_plain": step_price(rs, "inproc", "plain", 100)}}
    text = render({"smoke": True, "machine": {}, "configs": [conf]})
    assert "| tiny-omni | 900.0 | 818.2 | **0.909**" in text and "**1000.0**" in text


def test_step_cost_drives_the_same_hooks_in_process():
    """bench.step_cost's in-process variants: the shim's link over the session in this process
    (no sidecar started); every step reaches the hooks, each request's finish too (counts only)."""
    from bench.step_cost import measure

    res = measure(40, 4, 0.0, {"passthrough-inproc": "passthrough",
                               "observe-inproc": "bench.step_cost_hooks:ObservingPassThrough"})
    for r in res.values():
        assert r["sidecar_steps"] == r["shim_steps"] and r["losses"] == 0
        assert r["sidecar_tokens"] == 4 * r["shim_steps"]


def test_step_pace_is_the_median_step_period_and_reads_as_throughput(tmp_path):
    """A round's pace is its median step period from the core's stamps (a stalled step does not move
    it); pace ratios read like throughput ratios (shim 10 % slower per step: 0.909)."""
    stamps = [0.0, 0.01, 0.02, 0.5, 0.51, 0.52]  # one step stalled by 0.47 s
    assert abs(step_pace(stamps) - 10.0) < 1e-9 and step_pace([0.0, 1.0]) is None
    period = {"plain": 10.0, "shim": 11.0, "inproc": 10.5}
    rs = [{"block": b, "engine": e, "tokens": 900, "s": 1.0, "tok_s": 900.0, "step_ms": period[e]}
          for b in range(6) for e in block_order(b, tuple(period))]
    rs.append({"block": 6, "engine": "plain", "tokens": 900, "s": 1.0, "tok_s": 900.0, "step_ms": None})
    pace = summarize(rs, key="step_ms")
    assert abs(pace["ratio_median"] - 10 / 11) < 1e-4 and pace["blocks"] == 6
    assert pace["plain_step_ms_median"] == 10.0 and pace["ratio_of_medians"] == round(10 / 11, 4)
    assert pace["verdict"].endswith("agree within the effect")
    conf = {"config": "tiny-omni", "model": "tiny", "params_m": 0.39, "graphs": "eager", "dtype": "float32",
            "requests": 4, "max_tokens": 8, "status": "done", "summary": summarize(rs),
            "pace": {"shim_vs_plain": pace, "inproc_vs_plain": summarize(rs, "inproc", "plain", "step_ms"),
                     "shim_vs_inproc": summarize(rs, "shim", "inproc", "step_ms")}}
    text = render({"smoke": True, "machine": {}, "configs": [conf]})
    assert "| tiny-omni | 10.0 / 11.0 / 10.5 | **0.9091**" in text and "shim / inproc by step pace" in text


def test_pinning_plans_a_core_set_per_group_or_none_and_pins_every_thread():
    import os
    import threading

    from bench.pinning import pin_process, plan

    allowed = sorted(os.sched_getaffinity(0))
    assert plan({"a": len(allowed) + 1}) is None  # not enough for each to have its own
    cores = plan({"a": 1, "b": len(allowed) - 1})
    assert cores == {"a": allowed[:1], "b": allowed[1:]}
    stop = threading.Event()
    worker = threading.Thread(target=stop.wait)
    worker.start()
    try:
        assert pin_process(os.getpid(), allowed[:1]) >= 2  # this thread and the worker: every thread
        assert os.sched_getaffinity(worker.native_id) == {allowed[0]}  # a thread it did not start from
        assert os.sched_getaffinity(0) == {allowed[0]}
    finally:
        pin_process(os.getpid(), allowed)  # as it was
        stop.set()
        worker.join()
    assert os.sched_getaffinity(0) == set(allowed)


def test_the_gc_probe_counts_an_engines_collections_and_the_report_says_them(tmp_path):
    """bench.gpu's probe of Python's cycle collector in each engine's process (bench/gpu_models.py):
    each collection counted by generation with its pause, the file the forward writes read back per
    forward, and the report's line."""
    import gc

    from bench.gpu_models import GcProbe, read_gc_probe
    from bench.gpu_report import _collector

    probe = GcProbe(tmp_path / "gc.json")
    try:
        probe.forward()  # the first forward writes
        full = probe.collections[2]
        gc.collect()
        assert probe.collections[2] == full + 1 and probe.pause_us[2] > 0
        probe.forward()  # within GC_PROBE_WRITE_S of the first: not written
        assert read_gc_probe(tmp_path / "gc.json")["forwards"] == 1
        probe._write_due = 0.0
        probe.forward()
    finally:
        gc.callbacks.remove(probe._collected)
    got = read_gc_probe(tmp_path / "gc.json")
    assert got["forwards"] == 3 and got["collections"][2] == full + 1
    assert got["per_1000_forwards"][2] == round(1000 * (full + 1) / 3, 2)
    assert read_gc_probe(tmp_path / "absent.json") is None
    line, = _collector({"configs": [{"config": "tiny-omni", "gc": {"plain": got, "shim": None}}]})
    assert line.startswith("- tiny-omni, the cycle collector") and f"plain {got['pause_us_per_forward']} µs" in line
    assert "shim" not in line  # an engine whose probe wrote nothing is left out
    # Under FULL graphs a replay runs no Python forward: no figure per step (session 15 read 21810 µs
    # "a step" from 116 warm-up forwards), only what was counted.
    line, = _collector({"configs": [{"config": "tiny-passthrough", "graphs": "FULL_AND_PIECEWISE",
                                     "gc": {"plain": got}}]})
    assert "not priced per step" in line and "plain 3)" in line and "µs a step" not in line


def test_merged_runs_say_what_each_gives_the_section():
    """A run kept as a derived JSON (one of its configurations) must not read as if all it ran was merged."""
    from bench.gpu import merge_runs

    def run(date: str, configs: list[str], **parts: object) -> dict:
        """A run whose command named `configs`, kept with its last configuration only (a derived JSON)."""
        return {"date": date, "machine": {"commit": "abc1234", "argv": "--configs " + ",".join(configs) + " --x"},
                "elapsed_s": 10.0, "configs": [{"config": c, "status": "skipped", "error": "budget"} for c in configs[-1:]],
                **parts}

    row = {"requests": 64, "ring_p50": 18.6, "ring_p99": 66.0, "zmq_p50": 90.0, "zmq_p99": 99.0, "raw_p50": 70.0,
           "raw_p99": 80.0, "ratio_p50": 0.27}
    res = merge_runs([run("d1", ["tiny-omni"], refusal={"status": "refused", "message": "first"}),
                      run("d2", ["tiny-passthrough", "1b-passthrough"], exchange=[row]),
                      run("d3", ["tiny-passthrough"], exchange=[dict(row, requests=1)],
                          refusal={"status": "refused", "message": "m"})])
    assert [r["gives"] for r in res["runs"]] == [["tiny-omni", "refusal"], ["1b-passthrough", "exchange"],
                                                 ["tiny-passthrough"]]
    assert res["refusal"]["message"] == "first"
    assert res["exchange"] == [row]  # the first run that has a part gives it
    line = next(x for x in render(res).splitlines() if x.startswith("Runs merged"))
    assert "`--configs tiny-passthrough,1b-passthrough --x` (10.0 s; gives 1b-passthrough, exchange)" in line
