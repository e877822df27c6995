"""Crash isolation and hostile input, on a real vLLM V2 engine and real sidecar processes."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.support.procs import ROOT, child_env

pytestmark = pytest.mark.e2e


def test_kill_9_sidecar_mid_batch_20_times(tiny_model, tmp_path):
    out = tmp_path / "kill.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "support" / "kill_loop_job.py"), tiny_model,
         f"ipc://{tmp_path}/sc.sock", "20", str(out), str(tmp_path)],
        capture_output=True, text=True, env=child_env(OMNI_SIDECAR_STEP_TIMEOUT="2"), timeout=900,
    )
    assert out.exists(), proc.stdout[-3000:] + proc.stderr[-5000:]
    rounds = json.loads(out.read_text())
    assert len(rounds) == 20  # vLLM survived every kill
    for r in rounds:
        assert r["killed_rc"] == -9
        assert r["lengths"] == [2] * 4 + [64] * 4  # every request completed in vLLM
        errors = list(r["errors"].values())  # in the batch's order: 4 short, then 4 long
        short, long_ = errors[:4], errors[4:]
        assert all(e is None for e in short), r  # finished before the kill: unaffected
        assert all(e and "omni-sidecar lost" in e for e in long_), r  # live at the kill: explicit error
        assert r["losses"] == 1
        assert r["seconds"] < 2 + 10  # batch time + the step deadline: nothing hung
    assert all(r["reconnects"] == 1 for r in rounds[1:])  # the next sidecar is picked up
