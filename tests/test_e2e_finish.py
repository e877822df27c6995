"""Finish known when it happens: an offline `LLM.generate` with an external sidecar, then exit.

vLLM tells its workers that a request finished only on the next step; an
in-process engine that goes idle after its last outputs runs no such step. The
shim tells the sidecar itself (worker_shim/step/finishes.py): outputs are final and
streams end as soon as vLLM finishes a request, and a clean shutdown never
reports a completed request as failed.
"""

from __future__ import annotations

import re
import time

import pytest

from omni_sidecar.client import SidecarClient
from tests.support.procs import SidecarProcess, run_engine

pytestmark = pytest.mark.e2e
MAX_TOKENS = 8


def test_outputs_are_final_and_streams_end_without_another_request(tiny_model, e2e_dir, tmp_path):
    endpoint = f"ipc://{tmp_path}/sc.sock"
    sidecar = SidecarProcess(endpoint, "capture", tmp_path / "sidecar.log")
    prompts = [{"token_ids": list(range(10, 10 + n))} for n in (3, 17, 40, 5)]
    try:
        res = run_engine(
            {"model": tiny_model, "prompts": prompts, "max_tokens": MAX_TOKENS, "shim": True,
             "endpoint": endpoint, "mp": 0, "stream_last": 30},
            e2e_dir, "shim-finish",
        )
        assert res["ok"], res.get("traceback")
        # vLLM was idle while the job streamed its last request: the stream ended on its own
        # (it ends only once the sidecar has the request as finished), not at its 30 s timeout.
        assert res["stream_last"]["s"] < 1.0, res["stream_last"]
        # The engine process exited (clean shutdown): the session is gone, and every request
        # is final with all its hidden states, none failed.
        with SidecarClient(endpoint) as client:
            assert client.status().sessions == []
            for rid, prompt in zip(res["request_ids"], prompts):
                outs = client.outputs(rid)  # raises RequestFailed if reported failed
                assert outs is not None, rid
                assert outs["hidden_states"].shape[0] == len(prompt["token_ids"]) + MAX_TOKENS - 1
                t0 = time.monotonic()
                list(client.stream(rid, timeout_s=5))  # a finished request's stream returns at once
                assert time.monotonic() - t0 < 1.0
    finally:
        sidecar.stop()
    log = (tmp_path / "sidecar.log").read_text()
    assert not re.search(r"[1-9][0-9]* live request\(s\) end with an error", log), log[-3000:]
