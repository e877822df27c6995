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


def test_a_level_drives_speech_serving_s_load_client_and_reads_the_server_s_trace(monkeypatch):
    """one_level against a stand-in server over real HTTP: the load client it borrows from
    deploy/gpu/speech_serving.py runs, the client's TTFA and the trace's figures come back."""
    import json
    import time
    from types import SimpleNamespace

    from bench.speech_timeline import GPU, one_level

    monkeypatch.syspath_prepend(str(GPU))
    speeches: list[dict] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        method, path, _ = (await reader.readline()).decode().split(" ", 2)
        length = 0
        while (line := await reader.readline()) not in (b"\r\n", b""):
            key, _, value = line.decode().partition(":")
            length = int(value) if key.lower() == "content-length" else length
        body = await reader.readexactly(length)
        if method == "POST":
            speeches.append(json.loads(body))
            now = time.monotonic()
            audio = b"\x00\x01" * 8
            writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
                         + f"{len(audio):x}\r\n".encode() + audio + b"\r\n0\r\n\r\n")
            trace["requests"][f"speech-{len(speeches)}"] = {"arrived": now, "audio": now + 0.01}
        else:
            data = json.dumps(trace).encode()
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: " + str(len(data)).encode() + b"\r\n\r\n" + data)
        await writer.drain()
        writer.close()

    trace = {"requests": {}, "links": {}, "lags_ms": [0.1], "talker_outputs": {}, "wall_s": 1.0, "loop_cpu_share": 0.1}

    async def run() -> dict:
        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        async with server:
            args = SimpleNamespace(waves=2, frames=4, sample_rate=300, voices=("vivian",))
            return await one_level(port, 3, args, time.monotonic() + 30)

    got = asyncio.run(run())
    assert len(speeches) == 6 and all(s["voice"] == "vivian" for s in speeches)
    assert got["ok"] == 6 and got["requests"] == 6 and got["audio"]["p50"] == 10.0
    assert got["client_ttfa"]["p50"] > 0 and got["wall_s"] > 0
