"""`make demo`, the three-stage speech pipeline, run for real and checked against the stages by hand.

examples/demo.py starts three sidecars (omni-thinker, omni-talker, omni-code2wav) and three stage
processes, each with its own upstream vLLM V2 engine and the shim: a tiny Qwen2-VL thinker (text +
an image, M-RoPE, prefill chunked across the image) -> the tiny Qwen3-TTS-shaped talker (its own
model hooks, code predictor) -> the tiny code2wav. With --by-hand it then runs the talker and
code2wav stages again one after the other, each given the previous stage's whole output up front. The test reads what both runs wrote and checks:
- the stages overlapped (the thinker made slower than the talker, as real ones are, so the talker
  has to wait for rows): each talker request started before its thinker request finished and
  was fed rows by appends; each code2wav request started before its talker request finished
  and was fed frames by appends;
- the streamed run's codes equal the run by hand, and its audio equals the run by hand's;
- a WAV per request, of the right length and rate; the demo printed time to first audio and
  each stage's step latency.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import wave

import pytest

from tests.support.procs import ROOT

# `make test-slow` (about 45 s, three engines): `make demo` runs the same; make test's serve e2e
# checks the talker -> code2wav path over HTTP.
pytestmark = [pytest.mark.e2e, pytest.mark.slow]
REQUESTS = 2
ATOL = 1e-5  # the codec decodes each chunk in a different batch streamed and by hand
# The thinker slower than the talker (as real ones are): the talker must wait for its rows.
THINKER_DELAY_MS = 150


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo")
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "demo.py"), "--requests", str(REQUESTS),
                           "--by-hand", "--out", str(out), "--thinker-delay-ms", str(THINKER_DELAY_MS)],
                          cwd=ROOT, capture_output=True, text=True, timeout=1500,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    logs = "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(out.glob("*.log")))
    assert proc.returncode == 0, f"demo failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}\n{logs}"
    return {"stdout": proc.stdout, "out": out, **json.loads((out / "demo.json").read_text())}


def test_the_stages_stream_into_each_other_while_they_run(demo):
    stream = demo["stream"]
    thinker, talker, code2wav = stream["thinker"], stream["talker"], stream["code2wav"]
    for i in range(REQUESTS):
        rid = f"r{i}"
        assert talker["added_s"][rid] < thinker["requests"][rid]["finished_s"], rid
        assert talker["appends"].get(rid, 0) >= 1, rid  # thinker rows generated after the talker started
        assert code2wav["added_s"][rid] < talker["finished_s"][rid], rid
        assert code2wav["appends"].get(rid, 0) >= 1, rid
        assert 0 < code2wav["first_audio_s"][rid] < code2wav["finished_s"][rid], rid
    # By hand, every stage started after the previous one had finished everything: no appends.
    assert not demo["by_hand"]["talker"]["appends"] and not demo["by_hand"]["code2wav"]["appends"]


def test_the_streamed_audio_equals_the_stages_run_one_after_another_by_hand(demo):
    stream, hand = demo["stream"], demo["by_hand"]
    # By hand, each code2wav request started with its talker request's codes complete; streamed, none did.
    assert all(hand["code2wav"]["whole_at_add"].values()) and not any(stream["code2wav"]["whole_at_add"].values())
    for i in range(REQUESTS):
        rid = f"r{i}"
        codes = stream["talker"]["codes"][rid]
        assert codes == hand["talker"]["codes"][rid], rid
        assert len(codes) >= 8 and len({tuple(row) for row in codes}) > 1, rid  # frames, not all alike
        a, b = stream["code2wav"]["audio"][rid], hand["code2wav"]["audio"][rid]
        assert a["sr"] == b["sr"] and len(a["waveform"]) == len(b["waveform"]) > 0, rid
        worst = max(abs(x - y) for x, y in zip(a["waveform"], b["waveform"]))
        assert worst <= ATOL, (rid, worst)
        assert max(abs(x) for x in a["waveform"]) > 100 * ATOL, rid  # a real signal, not silence


def test_a_wav_per_request_and_the_latency_report(demo):
    from tests.tiny_models.code2wav import CODE2WAV_CONFIG

    stream = demo["stream"]
    for i in range(REQUESTS):
        rid = f"r{i}"
        with wave.open(str(demo["out"] / f"{rid}.stream.wav")) as wav:
            assert wav.getframerate() == CODE2WAV_CONFIG["output_sample_rate"] and wav.getnchannels() == 1
            assert wav.getnframes() == len(stream["code2wav"]["audio"][rid]["waveform"])
        assert f"[{rid}]" in demo["stdout"] and "time to first audio" in demo["stdout"]
    for stage in ("thinker", "talker", "code2wav"):
        assert f"     {stage}" in demo["stdout"]
        assert stream[stage]["steps"]["steps"] > 0 and stream[stage]["shim"]["steps"] > 0
    assert "same codes, audio equal" in demo["stdout"]
