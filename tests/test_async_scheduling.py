"""With async scheduling (vLLM's default on GPU) the engine calls the next step's execute_model before
it reads the last step's output; the shim's step path is the same, and no step waits for the
sidecar's work on the step before it (docs/ARCHITECTURE.md, "Async scheduling").

This drives the shim's real link, connection and rings against a real sidecar process with vLLM's
batch faked, as the engine's calls come with it on: each step's execute_model, then its
sample_tokens returning V2's AsyncOutput (not yet copied to the host), then the next step's.
tests/test_e2e_async_scheduling.py runs a real engine with it on; the step times with it on and off
are the GPU's to show (deploy/gpu).
"""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import msgspec
import pytest
import torch

from bench.step_cost import decode_state
from proto.messages import Hello
from proto.version import PROTOCOL_MAJOR, PROTOCOL_MINOR
from tests.support.procs import ROOT, SidecarProcess

HIDDEN = 8
SLOTS = 2  # the shim's default hidden_slots


class PendingOutput:
    """V2's AsyncOutput as sample_tokens returns it under async scheduling: its device-to-host copy
    still running. Reading its ids before the engine does would make the step wait for the device."""

    def __init__(self, req_ids: list[str], token: int) -> None:
        self.model_runner_output = SimpleNamespace(req_ids=req_ids)
        self.sampled_token_ids = [[token] for _ in req_ids]
        self.num_sampled_tokens_np = [1] * len(req_ids)
        self.copy_event = self
        self.waited = 0

    def synchronize(self) -> None:
        self.waited += 1


def _open_link(tmp_path, hooks: str, **settings):
    """A SidecarLink over the shim's real connection and rings to a sidecar serving `hooks`; returns
    (link, sidecar)."""
    from worker_shim.config import RingConfig
    from worker_shim.step.link import SidecarLink
    from worker_shim.wire.connection import SidecarConnection

    sidecar = SidecarProcess(f"ipc://{tmp_path}/sc.sock", hooks, tmp_path / "sidecar.log")
    hello = Hello(PROTOCOL_MAJOR, PROTOCOL_MINOR, "test", "none", "cpu", 0, 1, "m", HIDDEN, "float32", 64, [],
                  pid=os.getpid())

    def connect(endpoint: str = sidecar.endpoint, resume_token: str = "") -> SidecarConnection:
        return SidecarConnection(endpoint, 10.0, msgspec.structs.replace(hello, resume_token=resume_token),
                                 1 << 16, SLOTS, arena_prefix="omni-test-async", ring=RingConfig())

    try:
        conn = connect()
        conn.connect(10.0)
    except BaseException:
        sidecar.stop()
        raise
    return SidecarLink(connect, conn, **settings), sidecar


@pytest.fixture
def link(tmp_path):
    link, sidecar = _open_link(tmp_path, "tests.support.slow_reader_hooks:SlowReaderHooks", length_finishes=False)
    try:
        yield link
    finally:
        link.close()
        sidecar.stop()


def test_no_step_waits_for_the_sidecars_work_on_the_step_before(link):
    channel = link.conn.channel
    waited_for: list[tuple[int, int]] = []  # (the step waiting, the step whose result it waited for)
    take_results = channel.take_results

    def recording(until_step=None):
        if until_step is not None and channel.acked_step < until_step:
            waited_for.append((link.step, until_step))
        return take_results(until_step)

    channel.take_results = recording
    req_ids = [f"cmpl-{i}-abcdef12" for i in range(4)]
    link.note_new([SimpleNamespace(req_id=r, prompt_token_ids=[1, 2, 3], prompt_len=3,
                                   sampling_params=SimpleNamespace(extra_args=None)) for r in req_ids])
    outputs = []
    for step in range(12):  # execute_model, then sample_tokens; the engine reads outputs later
        link.note_finished(set(), None)
        link.begin_step()
        link.pre_forward(decode_state(req_ids, step).input_batch, None)
        link.end_step(decode_state(req_ids, step, torch.full((len(req_ids), HIDDEN), float(step))))
        outputs.append(PendingOutput(req_ids, step))
        link.note_sampled(outputs[-1])
    # The sidecar is slower than the steps: they did wait, each only for the step whose slot it
    # reuses, never for the one just before it.
    assert waited_for, "the steps never outran the sidecar: the test proves nothing"
    assert all(step - answered >= SLOTS for step, answered in waited_for), waited_for
    assert sum(o.waited for o in outputs) == 0  # no sampled ids read while the engine runs
    stats = link.stats()
    assert stats["steps"] == 12 and stats["blocking_exchanges"] == 0 and stats["losses"] == 0


def test_the_pass_through_step_path_reads_no_device_value_with_async_scheduling_on(tmp_path):
    """The pass-through set's steps as the worker runs them with async scheduling on (length finishes
    watched, stop tokens, the AsyncOutput of each step): the batch's input ids and the hidden rows
    are meta tensors, whose every host read (`.cpu()`, `.item()`, `.tolist()`, truth value) raises,
    and no AsyncOutput is waited for. A step then neither syncs the device nor waits for one."""
    link, sidecar = _open_link(tmp_path, "passthrough", async_scheduling=True)
    try:
        req_ids = [f"cmpl-{i}-abcdef12" for i in range(4)]
        link.note_new([SimpleNamespace(req_id=r, prompt_token_ids=[1, 2, 3], prompt_len=3,
                                       sampling_params=SimpleNamespace(extra_args=None, stop_token_ids=[7],
                                                                       eos_token_id=None, max_tokens=6))
                       for r in req_ids])
        outputs = []
        for step in range(8):
            finished = set(req_ids) if step == 6 else set()  # vLLM's notices of the length finishes
            link.note_finished(finished, None)
            link.begin_step()
            state = decode_state(req_ids if step < 6 else [], step, torch.empty((4, HIDDEN), device="meta"))
            state.input_batch.input_ids = torch.empty(4, dtype=torch.int64, device="meta")
            with pytest.raises(NotImplementedError):  # what any host read of them does
                state.input_batch.input_ids.tolist()
            assert link.pre_forward(state.input_batch, None) == {}
            link.end_step(state)
            outputs.append(PendingOutput(state.input_batch.req_ids, 7 if step == 4 else 5))
            link.note_sampled(outputs[-1])
        stats = link.stats()
        assert stats["steps"] == 8 and stats["blocking_exchanges"] == 0 and stats["losses"] == 0
        assert stats["finished_requests"] == 4
        assert sum(o.waited for o in outputs) == 0  # no sampled ids read while the engine runs
    finally:
        link.close()
        sidecar.stop()


# -- deploy/gpu/async_scheduling.py: the GPU check's argument handling and comparison, on made-up results


def _gpu_check():
    import importlib.util

    spec = importlib.util.spec_from_file_location("async_scheduling_check", ROOT / "deploy/gpu/async_scheduling.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _rounds(ms, forwards=40, t0=1000.0, on_first=True):
    """Timed rounds as async_engines.py records them: every request's decode time per token (s) around
    the round's `ms`; rounds 10 s apart, the on engine's turn first in even rounds (ABBA)."""
    out = []
    for r, m in enumerate(ms):
        first = (r % 2 == 0) == on_first
        out.append({"decode_s": [m * 1e-3 * f for f in (0.99, 1.0, 1.01)], "steps": forwards + 2, "forwards": forwards,
                    "wall_s": 0.2, "start_unix": t0 + 10 * r + (0 if first else 1), "turn_wait_s": 0.0})
    return out


def _llama_result(tmp_path, name, async_on, rows, tokens=None, reasons=None, ms=(5.0,) * 8, forwards=40):
    import numpy as np

    tokens = tokens or [[1, 2, 3], [4, 5]]
    reasons = reasons or ["length", "stop"]
    outputs = {}
    for i, n in enumerate(rows):
        path = tmp_path / f"{name}-{i}.npy"
        np.save(path, np.full((n, 4), float(i), dtype=np.float32), allow_pickle=False)
        outputs[f"check-{i}"] = {"hidden_states": str(path)}
    return {"ok": True, "async_scheduling": async_on,
            "run": {"ids": [f"check-{i}" for i in range(len(rows))], "tokens": tokens, "finish_reasons": reasons,
                    "outputs": outputs},
            "rounds": _rounds(ms, forwards, on_first=async_on)}


def test_the_gpu_checks_arguments_and_plan(capsys):
    check = _gpu_check()
    assert check.main(["--plan", "--sets", "capture,talker"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert [(e["name"], e["async"], e["hooks"]) for e in plan] == [
        ("capture-async-on", True, "capture"), ("capture-async-off", False, "capture"),
        ("talker-async-on", True, "omni-talker"), ("talker-async-off", False, "omni-talker")]
    assert len(check.engine_specs(check.SETS)) == 12
    assert check.parse(["--plan"]).rounds == check.ROUNDS >= 6
    for bad in (["--plan", "--sets", "capture,nope"], ["--sets", "capture"], ["--out", "x", "--sets", "talker"],
                ["--plan", "--rounds", "0"], ["--plan", "--tokens", "4"], ["--plan", "--tokens", "1000"]):
        with pytest.raises(SystemExit):
            check.parse(bad)


def test_the_gpu_checks_timed_rounds_alternate_each_sets_engines_and_time_the_same_work(tmp_path):
    """Every engine's job: the timed engines in one order, each set's on and off side by side, so
    Turns runs each pair's rounds on, off then off, on (ABBA); every timed engine decodes
    TIMED_REQUESTS requests of TIMED_TOKENS tokens, none with stop tokens."""
    check = _gpu_check()
    from talker_engines import Turns

    args = check.parse(["--out", str(tmp_path), "--tts-model", "tts"])
    specs = check.engine_specs(args.sets)
    embeds = [str(tmp_path / f"e{i}.npy") for i in range(3)]
    jobs = {s["name"]: check.job_for({**s, "endpoint": "ipc://x"}, args, "llama", embeds, len(specs), 123.0)
            for s in specs}
    orders = {json.dumps(Turns({**job, "workdir": str(tmp_path)}).order) for job in jobs.values()}
    assert len(orders) == 1  # every engine counts the same turns
    order = json.loads(orders.pop())
    assert len(order) == 10 * args.rounds  # code2wav is not timed
    for s in check.TIMED_SETS:
        for r in range(args.rounds):
            keys = [f"{s}-async-{m}|timed|{r}" for m in (("on", "off") if r % 2 == 0 else ("off", "on"))]
            i = order.index(keys[0])
            assert order[i + 1] == keys[1], (s, r)
    for name, job in jobs.items():
        assert job["deadline_unix"] == 123.0
        if name.startswith(("talker", "code2wav")):
            reqs = job["bench_sets"][0]["reqs"]
            assert job["max_num_seqs"] >= len(reqs) == check.TIMED_REQUESTS
        else:
            reqs = job["timed_requests"]
            assert all(("embeds_file" in r) == name.startswith("overlay") for r in reqs)
        assert len(reqs) == check.TIMED_REQUESTS
        assert all(r["max_tokens"] == check.TIMED_TOKENS and not r.get("stop_token_ids") for r in reqs)
    longer = check.parse(["--out", str(tmp_path), "--tts-model", "tts", "--tokens", "128"])
    for spec in (specs[0], specs[-4]):  # a Llama set's engine, the talker's
        job = check.job_for({**spec, "endpoint": "ipc://x"}, longer, "llama", embeds, len(specs), 123.0)
        reqs = job.get("timed_requests") or job["bench_sets"][0]["reqs"]
        assert {r["max_tokens"] for r in reqs} == {128}


def test_the_gpu_checks_llama_engines_time_their_rounds_in_turn_and_a_deadline_cuts_them_alike(tmp_path, monkeypatch):
    """async_engines.timed_rounds of a set's two engines side by side (threads), the round itself
    faked: on, off, then off, on; each round's forwards counted; the deadline passes after the second
    round: both keep two rounds, neither waits a whole turn timeout for the other."""
    import importlib.util
    import threading
    import time

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # what the engine script sets, restored after
    spec = importlib.util.spec_from_file_location("async_engines_check", ROOT / "deploy/gpu/async_engines.py")
    engines = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(engines)
    started: list[str] = []

    class Engine:
        def __init__(self, name: str) -> None:
            self.name, self.forwards = name, 0

        def collective_rpc(self, method: str) -> list[dict]:
            assert method == "omni_sidecar_stats"
            return [{"steps": self.forwards}]

    def timed_round(llm, specs, prefix):
        started.append(f"{llm.name}|{prefix}")
        time.sleep(0.01)
        llm.forwards += 7
        return {"decode_s": [0.004], "step_s": [0.001] * 5}

    monkeypatch.setattr(engines, "timed_round", timed_round)
    import talker_engines  # the module async_engines takes its turns from

    monkeypatch.setattr(talker_engines, "past_deadline", lambda job: sum(s.endswith("-1-") for s in started) >= 2)
    names = ["p-async-on", "p-async-off"]
    results = {}

    def run(name):
        job = {"workdir": str(tmp_path), "name": name, "engines": names, "turn_wait_s": 20, "timed_requests": [],
               "bench_sets": [{"name": "timed", "rounds": 4}]}
        results[name] = engines.timed_rounds(Engine(name), job)

    threads = [threading.Thread(target=run, args=(n,)) for n in names]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert started == ["p-async-on|timed-0-", "p-async-off|timed-0-", "p-async-off|timed-1-", "p-async-on|timed-1-"]
    for rounds, cut in results.values():
        assert len(rounds) == 2 and cut == 2
        assert [r["forwards"] for r in rounds] == [7, 7] and all(r["steps"] == 5 for r in rounds)
        assert all(r["turn_wait_s"] < 10 for r in rounds)


def test_the_gpu_check_passes_identical_results_and_names_what_differs(tmp_path):
    check = _gpu_check()
    same = check.report({"capture-async-on": _llama_result(tmp_path, "a", True, [5, 3]),
                         "capture-async-off": _llama_result(tmp_path, "b", False, [5, 3])}, ["capture"], 0.05)
    assert same["all_ok"], same
    assert same["sets"][0]["figures"] == {"identical_tokens": "2/2", "stopped_by_token": 1, "outputs_compared": 2,
                                          "outputs_max_abs_diff": 0.0}
    cases = {
        # the stopped request's discarded forward kept: one row more with it on
        "shape [4, 4] with async scheduling on, [3, 4] off": dict(rows=[5, 4]),
        "tokens differ": dict(tokens=[[1, 2, 3], [4, 6]]),
        "finish reasons differ": dict(reasons=["length", "length"]),
    }
    for why, changed in cases.items():
        on = _llama_result(tmp_path, "c", True, **{"rows": [5, 3], **changed})
        got = check.report({"capture-async-on": on, "capture-async-off": _llama_result(tmp_path, "d", False, [5, 3])},
                           ["capture"], 0.05)
        assert not got["all_ok"] and any(why in f for f in got["sets"][0]["failures"]), (why, got)
    off_as_on = check.report({"capture-async-on": _llama_result(tmp_path, "e", False, [5, 3]),
                              "capture-async-off": _llama_result(tmp_path, "f", False, [5, 3])}, ["capture"], 0.05)
    assert any("async scheduling was" in f for f in off_as_on["sets"][0]["failures"])
    no_stop = check.report({"capture-async-on": _llama_result(tmp_path, "g", True, [5, 3], reasons=["length"] * 2),
                            "capture-async-off": _llama_result(tmp_path, "h", False, [5, 3], reasons=["length"] * 2)},
                           ["capture"], 0.05)
    assert any("no request ended on a stop token" in f for f in no_stop["sets"][0]["failures"])
    missing = check.report({"capture-async-on": {"ok": False, "error": "died"}}, ["capture"], 0.05)
    assert missing["sets"][0]["failures"] == ["async on: died", "async off: no result"]
    assert missing["sets"][0]["timing"]["verdict"] == "not measured"
    table = check.table(same)
    assert ("| capture | 2/2 | 1 | 5.0 | 5.0 | 1.000; 1.000..1.000; 1.000..1.000 | 8 | on no worse than off | PASS |"
            in table), table
    json.dumps(same)  # what async-scheduling.json holds


def test_the_gpu_checks_timing_is_the_median_of_round_ratios_with_its_interval_and_a_verdict(tmp_path):
    """Per round on / off of the decode time per token; the verdict from the bootstrap interval of
    their median; a verdict, never a failure of the set's results."""
    check = _gpu_check()
    off_ms = (5.0, 5.2, 4.9, 5.1, 5.0, 5.3, 4.8, 5.0)

    def timed(on_ms, off=off_ms, on_forwards=40):
        got = check.report({"capture-async-on": _llama_result(tmp_path, "on", True, [5, 3], ms=on_ms,
                                                              forwards=on_forwards),
                            "capture-async-off": _llama_result(tmp_path, "off", False, [5, 3], ms=off)},
                           ["capture"], 0.05)
        assert got["all_ok"], got  # the results are the same whatever the timing says
        return got["sets"][0]["timing"]

    # Async on runs more forwards for the same tokens (and its engine steps differ): the decode time per
    # token a client sees is what is compared, not time per forward.
    same = timed([m * 1.01 for m in off_ms], on_forwards=48)
    assert same["verdict"] == "on no worse than off"
    assert same["rounds"] == 8 and same["ratio"] == pytest.approx(1.01, abs=1e-3)
    assert same["ci95"][1] <= 1.05 and same["min"] <= same["ratio"] <= same["max"]
    # Every round of both engines kept, with its order: on first, then off first (ABBA).
    assert [r["decode_ms"] for r in same["off_rounds"]] == pytest.approx(list(off_ms))
    assert [r["forwards"] for r in same["on_rounds"]] == [48] * 8 and [r["forwards"] for r in same["off_rounds"]] == [40] * 8
    assert same["first"] == ["on", "off"] * 4
    assert same["round_ratios"] == pytest.approx([1.01] * 8, abs=1e-3)

    slower = timed([m * 1.3 for m in off_ms])
    assert slower["verdict"] == "on slower than off" and slower["ci95"][0] > 1.05
    # Rounds that disagree (noise larger than the tolerance): the interval straddles 1 + tolerance.
    noisy = timed([m * f for m, f in zip(off_ms, (0.85, 1.3, 0.95, 1.2, 1.0, 1.25, 0.9, 1.15))])
    assert noisy["verdict"] == "not resolved" and noisy["ci95"][0] <= 1.05 < noisy["ci95"][1]
    few = timed(off_ms[:3], off=off_ms[:3])
    assert few["rounds"] == 3 and few["ratio"] == 1.0 and few["verdict"] == "not resolved"
    # Rounds pair by index: the off engine's rounds cut by the deadline leave the on engine's extra unpaired.
    cut = timed(off_ms, off=off_ms[:5])
    assert cut["rounds"] == 5 and len(cut["on_rounds"]) == 8
    summary = check.report({"capture-async-on": _llama_result(tmp_path, "a", True, [5, 3], ms=[m * 1.3 for m in off_ms]),
                            "capture-async-off": _llama_result(tmp_path, "b", False, [5, 3], ms=off_ms)},
                           ["capture"], 0.05)
    assert summary["timing_verdicts"] == {"on slower than off": 1}
    assert "| on slower than off | PASS |" in check.table(summary)


def test_the_gpu_check_compares_talker_codes_and_code2wav_waveforms():
    check = _gpu_check()
    codes = {"tokens": [[1] * 24, [2] * 7], "codes": [[[1, 2]] * 24, [[3, 4]] * 7],
             "decode_s": [], "step_s": []}
    talker = {"ok": True, "codes": codes, "bench": {"timed": _rounds((4.5,) * 6)}}
    waves = {"ok": True, "waveforms": {"c2w-0-25": [0.0, 0.5, -1.0]}}
    results = {"talker-async-on": {**talker, "async_scheduling": True}, "talker-async-off": {**talker, "async_scheduling": False},
               "code2wav-async-on": {**waves, "async_scheduling": True},
               "code2wav-async-off": {**waves, "async_scheduling": False}}
    summary = check.report(results, ["talker", "code2wav"], 0.05)
    assert summary["all_ok"], summary
    timing = summary["sets"][0]["timing"]
    assert (timing["on_ms"], timing["off_ms"], timing["ratio"], timing["rounds"]) == (4.5, 4.5, 1.0, 6)
    assert timing["verdict"] == "on no worse than off"
    assert summary["sets"][1]["timing"]["verdict"] == "not measured"  # code2wav: a step per chunk
    extra = {**codes, "codes": [[[1, 2]] * 24, [[3, 4]] * 8]}  # one frame more for the stopped request
    longer = {"ok": True, "waveforms": {"c2w-0-25": [0.0, 0.5, -1.0, 0.2]}}
    bad = check.report({**results, "talker-async-on": {**talker, "codes": extra, "async_scheduling": True},
                        "code2wav-async-on": {**longer, "async_scheduling": True}}, ["talker", "code2wav"], 0.05)
    assert bad["sets"][0]["failures"] == ["request 1: codes differ (8 frames on, 7 off)"]
    assert "shape [4] with async scheduling on, [3] off" in bad["sets"][1]["failures"][0]
