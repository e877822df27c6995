"""deploy/gpu/speech_serving.py's load client and figures, against a stand-in HTTP server (the GPU run
serves both real servers; `python deploy/gpu/speech_serving.py --ours-pipeline deploy/speech/tiny.toml
--servers ours --sample-rate 300 --voices default,vivian,ryan --frames 24 --levels 1,4,8 --work W --result
R/speech-serving.json` runs the whole driver against omni-serve on CPU: about 4.5 min on 2 cores)."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "deploy" / "gpu"))

import speech_serving as serving  # noqa: E402

RATE = 100
AUDIO = bytes(range(200)) * 2  # 400 bytes: 200 samples, 2 s at RATE


def _stand_in(gap_s: float):
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """POST: the audio, chunked in two parts gap_s apart; GET: a JSON body with a length; a
        request whose voice is "nobody": a 400."""
        head = await reader.readuntil(b"\r\n\r\n")
        lines = head.split(b"\r\n")
        length = int(next(line.split(b":")[1] for line in lines if line.lower().startswith(b"content-length")))
        body = json.loads(await reader.readexactly(length)) if length else None
        if body is None:
            data = b'{"status": "ok"}'
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(data) + data)
        elif body.get("voice") == "nobody":
            data = b'{"error": {"message": "unknown voice"}}'
            writer.write(b"HTTP/1.1 400 Bad Request\r\nContent-Length: %d\r\n\r\n" % len(data) + data)
        else:
            writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
            for part in (AUDIO[:100], AUDIO[100:]):
                writer.write(b"%x\r\n" % len(part) + part + b"\r\n")
                await writer.drain()
                await asyncio.sleep(gap_s)
            writer.write(b"0\r\n\r\n")
        await writer.drain()
        writer.close()

    return serve


async def _serving(test, gap_s: float = 0.05):
    server = await asyncio.start_server(_stand_in(gap_s), "127.0.0.1", 0)
    try:
        return await test(server.sockets[0].getsockname()[1])
    finally:
        server.close()
        await server.wait_closed()


def test_a_stream_is_read_whole_and_its_first_audio_timed_before_its_end():
    async def test(port):
        got = await serving.request(port, "POST", "/v1/audio/speech", serving.speech_body("hi", "vivian", 8, True))
        health = await serving.request(port, "GET", "/health", None)
        refused = await serving.request(port, "POST", "/v1/audio/speech", serving.speech_body("hi", "nobody", 8, False))
        return got, health, refused

    got, health, refused = asyncio.run(_serving(test))
    assert got.status == 200 and got.body == AUDIO
    assert 0 < got.t_first_audio < got.t_total and got.t_total - got.t_first_audio >= 0.04
    assert health.status == 200 and json.loads(health.body) == {"status": "ok"}
    assert refused.status == 400 and "unknown voice" in refused.error and refused.t_first_audio is None


def test_a_round_times_each_streamed_answer():
    async def test(port):
        return await serving.one_round(port, 4, 8, 8, RATE, time.monotonic() + 60)

    got = asyncio.run(_serving(test, gap_s=0.01))
    assert got.requests == 8 and got.errors == [] and got.audio_s == [2.0] * 8
    assert all(0 < t < total * 1000 for t, total in zip(got.ttfa_ms, got.total_s))
    assert 0.04 <= got.wall_s < 5  # two waves of 4, each two gaps long


def test_rounds_give_ttfa_over_all_their_requests_audio_seconds_per_second_rtf_and_their_spread():
    rounds = [serving.Round(4, 2.0, [10.0, 20.0, 30.0, 40.0], [1.0] * 4, [0.5, 0.5, 0.5, 1.0], []),
              serving.Round(4, 4.0, [50.0, 60.0, 70.0], [2.0] * 3, [1.0, 1.0, 1.0], ["a 503"])]
    got = serving.figures(rounds)
    assert got["rounds"] == 2 and got["requests"] == 8 and got["ok"] == 7 and got["errors"] == ["a 503"]
    assert got["ttfa_ms_p50"] == 40.0 and got["ttfa_ms_p95"] == 70.0  # over all 7 requests
    assert got["audio_s_per_s"] == round(10.0 / 6.0, 3) and got["audio_s_per_request"] == 1.0
    assert got["rtf"] == 0.5  # medians of 0.5, 0.5, 0.5, 1.0, 0.5, 0.5, 0.5
    assert got["spread"]["ttfa_ms_p95"] == {"rounds": 2, "median": 55.0, "min": 40.0, "max": 70.0, "ci95": [40.0, 70.0]}
    assert got["spread"]["audio_s_per_s"]["min"] == 1.5 and got["spread"]["audio_s_per_s"]["max"] == 2.0
    rows = serving.table({"ours": {"4": got}})
    assert rows.splitlines()[2] == "| ours | 4 | 40.0 | 70.0 (40.0..70.0) | 1.667 (1.5..2.0) | 0.5 | 2 | 7/8 | - |"


def test_a_level_warms_each_server_up_then_times_abba_blocks_and_their_ratios():
    """Two servers (both the stand-in): per level one untimed round each, then blocks of two rounds each
    in ABBA, then BAAB order; the figures are the timed rounds', the ratios the blocks'."""
    import argparse

    async def test(port):
        servers = {name: serving.ServerProcess(name, port, None, Path("/dev/null"))  # type: ignore[arg-type]
                   for name in ("ours", "vllm-omni")}
        args = argparse.Namespace(frames=8, sample_rate=RATE, voices=["vivian"], max_blocks=2)
        results = {"ours": {}, "vllm-omni": {}, "ours_over_vllm_omni": {}, "notes": []}
        done = await serving.measure_level(servers, 1, 4, args, time.monotonic() + 60, 1, results)
        return done, results

    done, results = asyncio.run(_serving(test, gap_s=0.002))
    assert done and results["notes"] == []
    for name in ("ours", "vllm-omni"):
        got = results[name]["4"]
        assert got["rounds"] == 4 and got["requests"] == got["ok"] == 32  # two blocks, two rounds each
        assert got["warm_up"]["ok"] == 8
    ratios = results["ours_over_vllm_omni"]["4"]
    assert ratios["ttfa_ms_p95_ratio"]["blocks"] == ratios["audio_s_per_s_ratio"]["blocks"] == 2
    assert 0.5 < ratios["audio_s_per_s_ratio"]["median"] < 2  # the same stand-in behind both
    rows = serving.benchmarks_rows({**results, "codes_note": serving.CODES_NOTE}).splitlines()
    assert [row.split(" | ")[0] for row in rows[2:4]] == ["| ours", "| vllm-omni"]
    assert rows[-1].startswith("Ours over vllm-omni at 4, per ABBA block") and "(2 blocks)" in rows[-1]


def test_a_level_with_no_time_left_times_nothing_and_says_so():
    import argparse

    async def test(port):
        servers = {"ours": serving.ServerProcess("ours", port, None, Path("/dev/null"))}  # type: ignore[arg-type]
        args = argparse.Namespace(frames=8, sample_rate=RATE, voices=["vivian"], max_blocks=2)
        results = {"ours": {}, "notes": []}
        return await serving.measure_level(servers, 0, 4, args, time.monotonic() + 0.005, 1, results), results

    done, results = asyncio.run(_serving(test, gap_s=0.01))
    assert not done and results["ours"] == {} and "no timed block" in results["notes"][0]


def test_percentiles_pick_the_nearest_rank():
    values = list(range(1, 101))
    assert serving.percentile(values, 50) == 51 and serving.percentile(values, 95) == 95
    assert serving.percentile([7.0], 95) == 7.0


def test_the_speakers_and_exact_frames_come_from_the_checkpoint(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"tts_model_type": "voice_design", "talker_config": {
        "codec_eos_token_id": 66, "spk_id": {}, "spk_is_dialect": {}}}))
    serving.with_speakers(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["tts_model_type"] == "custom_voice"
    assert config["talker_config"]["spk_id"] == {"vivian": 72, "ryan": 73}
    assert serving.exact_frames(tmp_path, 48) == {"max_tokens": 48, "min_tokens": 48, "stop_token_ids": [66]}


def test_each_stages_share_of_first_audio_is_its_mean_between_two_scrapes():
    before = serving.first_audio_shares(
        'omni_serve_stage_first_audio_seconds_sum{stage="talker"} 1.0\n'
        'omni_serve_stage_first_audio_seconds_count{stage="talker"} 4.0\n'
        'omni_serve_stage_first_audio_seconds_bucket{stage="talker",le="0.5"} 4.0\n')
    after = serving.first_audio_shares(
        'omni_serve_stage_first_audio_seconds_sum{stage="talker"} 1.6\n'
        'omni_serve_stage_first_audio_seconds_count{stage="talker"} 6.0\n'
        'omni_serve_stage_first_audio_seconds_sum{stage="code2wav"} 0.05\n'
        'omni_serve_stage_first_audio_seconds_count{stage="code2wav"} 2.0\n')
    assert before == {"talker": (1.0, 4.0)}
    assert serving.shares_between(before, after) == {"talker": 300.0, "code2wav": 25.0}
    assert serving.shares_between(after, after) == {}  # no request between: no share


def test_the_shares_are_read_from_omni_serves_own_metrics_text():
    from omni_serve.api.metrics import SpeechMetrics

    metrics = SpeechMetrics(["talker", "code2wav"])
    before = serving.first_audio_shares(metrics.text().decode())
    for stage, seconds in [("talker", 0.25), ("talker", 0.75), ("code2wav", 0.125)]:
        metrics.first_audio_share.labels(stage).observe(seconds)
    assert serving.shares_between(before, serving.first_audio_shares(metrics.text().decode())) == {
        "talker": 500.0, "code2wav": 125.0}


def test_a_metrics_scrape_that_fails_gives_no_shares_and_the_run_goes_on():
    """The first-audio shares are extra: a server that does not answer /metrics leaves them out."""
    import socket

    with socket.socket() as free:  # a port nothing listens on
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    server = serving.ServerProcess("ours", port, None, Path("/dev/null"))  # type: ignore[arg-type]
    assert asyncio.run(serving.scrape_shares(server)) == {}


def test_codes_are_compared_ask_by_ask_and_the_first_asks_counted():
    import numpy as np

    a, b, c = np.zeros((3, 4), int), np.ones((3, 4), int), np.ones((2, 4), int)
    per_request = [{"voice": "x"}, {"voice": "y"}]
    got = serving.compare_codes({"vllm-omni": [a, a, b, b], "ours": [a, a, c, b]}, per_request)
    assert got == {"codes_identical": "1/2"}
    assert per_request[0]["codes_identical"] == [True, True] and per_request[1]["codes_identical"] == [False, True]
    assert per_request[1]["frames"] == {"vllm-omni": [3, 3], "ours": [2, 3]}
    # A server that recorded another number of requests than were asked: no count, and why.
    short = serving.compare_codes({"vllm-omni": [a, a, b], "ours": [a, a, c, b]}, [{}, {}])
    assert short["codes_identical"] is None and "vllm-omni 3" in short["codes_note"]
