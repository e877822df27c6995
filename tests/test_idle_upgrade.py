"""Hot upgrades that complete while vLLM is idle (docs/ARCHITECTURE.md, Hot upgrade):
a real vLLM V2 engine with the shim, real sidecar processes, the `omni-sidecar upgrade` command."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.support.procs import ROOT, child_env

pytestmark = pytest.mark.e2e


def test_upgrades_complete_under_an_idle_engine_and_alternate_with_busy_ones(tiny_model, tmp_path):
    from tests.support.procs import SidecarProcess

    endpoint = f"ipc://{tmp_path}/sc.sock"
    first = SidecarProcess(endpoint, "tests.support.state_hooks:StateCheckHooks", tmp_path / "sidecar.log")
    out = tmp_path / "idle.json"
    try:
        proc = subprocess.run(
            [sys.executable, str(ROOT / "tests" / "support" / "idle_upgrade_job.py"), tiny_model, endpoint, str(out)],
            capture_output=True, text=True, env=child_env(), timeout=600,
        )
        assert out.exists(), proc.stdout[-3000:] + proc.stderr[-5000:]
    finally:
        first.stop()
        subprocess.run(["pkill", "-f", "--", f"--endpoint {endpoint}"], check=False)
    res = json.loads(out.read_text())
    # Five upgrades with no traffic: each returns 0 within 2 s (the old sidecar hands the idle
    # session over at once), and they chain: the batch after them is served by the last hook set.
    idle = res["idle"]
    assert [u["rc"] for u in idle] == [0] * 5, idle
    # Within 2 s of work: the two Python processes an upgrade starts (the command, the new
    # sidecar) import torch first, which alone takes seconds on a loaded 2-core machine.
    bound = 2.0 + 2 * res["cold_start_s"]
    assert all(u["seconds"] < bound for u in idle), ([u["seconds"] for u in idle], bound)
    assert res["status_before_batch"] == "state-check-last"
    after = res["stats_after_idle"]
    assert after["hook_set"] == "state-check-last" and after["switches"] == 1
    assert after["request_errors"] == {} and after["losses"] == 0
    assert res["after_idle"] == res["ref"]
    # Ten more, alternating idle and busy: no failed request, tokens as without upgrades.
    alternating = res["alternating"]
    assert [u["rc"] for u in alternating] == [0] * 10, alternating
    assert [u["busy"] for u in alternating] == [False, True] * 5
    stats = res["stats"]
    assert stats["request_errors"] == {} and stats["losses"] == 0  # state checked at every step
    assert stats["switches"] == 1 + 10
    assert res["tokens"] == [res["ref"]] * 5
