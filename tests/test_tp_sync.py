"""TP>1: rank 0's overlay rows and kwargs land on every rank, on the same steps (gloo on CPU)."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.support.procs import ROOT, child_env


def test_rank0_overlay_rows_and_kwargs_reach_the_other_rank(tmp_path):
    job = ROOT / "tests" / "support" / "tp_job.py"
    init = tmp_path / "init"
    procs = [subprocess.Popen([sys.executable, str(job), str(r), str(init), str(tmp_path / f"r{r}.json")],
                              env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
             for r in (0, 1)]
    for p in procs:
        out, _ = p.communicate(timeout=120)
        assert p.returncode == 0, out.decode()[-3000:]
    r0, r1 = (json.loads((tmp_path / f"r{r}.json").read_text()) for r in (0, 1))
    assert r1["needs"] == r0["needs"] == "prefill"  # rank 0's handshake reached rank 1
    # Same broadcast schedule on both ranks: the prefill step with a payload request only.
    assert r0["schedule"] == r1["schedule"] == [True, False]
    assert r0["after_finish"] is r1["after_finish"] is False
    # Rank 1's own buffer now holds rank 0's overlaid rows, in place (CUDA graphs read it).
    assert r1["embeds"] == r0["embeds"]
    assert r1["embeds"][1] == [1.0, 2.0, 3.0, 4.0] and r1["embeds"][0] == [0.0] * 4
    assert r1["same_buffer"] is True
    # JSON-like kwargs reach every rank; tensor kwargs are dropped on all of them alike.
    assert r0["keys"] == r1["keys"] == ["inputs_embeds", "spans"]
    assert r1["spans"] == [[0, 4]]
