"""bench/speech_timeline.py's figures from a server's trace (pure functions: no server)."""

from __future__ import annotations

import asyncio
import contextlib

from bench.speech_timeline import EngineProbe, Trace, medians, speech_id, summary


def test_a_chunk_request_names_its_speech_request():
    assert speech_id("speech-ab12-c0") == ("speech-ab12", "c0")
    assert speech_id("speech-ab12-c13") == ("speech-ab12", "c13")
    assert speech_id("speech-ab12") == ("speech-ab12", None)
    assert speech_id("speech-cat") == ("speech-cat", None)  # "cat" is no chunk index


def test_milestones_are_ms_from_arrival_over_requests_that_got_audio():
    trace = {"requests": {f"r{i}": {"arrived": 10.0, "talker_submit": 10.001 * (1 + i), "audio": 10.5 + i}
                          for i in range(3)} | {"gone": {"arrived": 1.0}},
             "links": {"talker.outputs": {"calls": 4, "wait_s": 0.02, "max_waiting": 3}},
             "lags_ms": [0.1, 0.2, 5.0], "talker_outputs": {"r0": 48, "r1": 48, "r2": 40}, "wall_s": 2.0,
             "loop_cpu_share": 0.5}
    got = summary(trace)
    assert got["requests"] == 3
    assert got["audio"] == {"p50": 1500.0, "p95": 2500.0}
    assert got["links"] == {"talker.outputs": {"calls": 4, "mean_wait_ms": 5.0, "max_waiting": 3}}
    assert got["loop_lag_ms"]["max"] == 5.0 and got["talker_outputs_per_request"] == 48
    assert got["loop_cpu_us_per_talker_output"] == round(0.5 * 2.0 / 136 * 1e6, 1)
    got["wall_s"] = 2.0  # the load client's
    rounds = [got, {**got, "audio": {"p50": 1000.0, "p95": 3000.0}, "loop_cpu_us_per_talker_output": 1.0}]
    assert medians(rounds)["audio"] == {"p50": [1250.0, 1000.0, 1500.0], "p95": [2750.0, 2500.0, 3000.0]}


def test_an_engine_probe_marks_a_requests_first_output_and_passes_every_output_on():
    class Engine:
        async def generate(self, prompt, params, request_id):
            for i in range(3):
                yield i

    trace = Trace()

    async def run() -> list[int]:
        probe = EngineProbe(Engine(), "code2wav", trace)
        async with contextlib.aclosing(probe.generate({}, None, "speech-x-c0")) as outs:
            return [o async for o in outs]

    assert asyncio.run(run()) == [0, 1, 2]
    marks = trace.requests["speech-x"]
    assert set(marks) == {"c0_submit", "c0_out"} and marks["c0_submit"] <= marks["c0_out"]
