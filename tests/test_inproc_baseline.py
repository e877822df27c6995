"""The bench's in-process baseline is honest: the same hooks give the same plans and outputs.

bench/inproc.py runs a hook set inside the vLLM worker (no sidecar process) so the bench can
price the process boundary. That price means something only if both engines do
the same work: here the omni hook set working every step (extra kwargs through a plan each
step, prefill overlays from payloads, chunked prefill next to decodes, last-layer and two
captured layers' hidden states, per-request postprocess) runs once through a real sidecar and
once in-process on real vLLM V2 (CPU), and everything observable must be equal: the greedy
tokens, the extra kwargs the model's forward saw at every step, every request's assembled
outputs bit for bit, and the shim's step counts. No timings here (bench/gpu_ab.py measures).
"""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from tests.support.procs import SidecarProcess, run_engine, write_embeds

pytestmark = pytest.mark.e2e

HOOKS, OPTIONS = "omni", ["extra_kwargs=1", "hidden_layers=0,1"]
# The 100-token prompt prefills in chunks (64 tokens a step) next to decodes; nine requests, so each
# decode step's plan holds several last rows of one kind: stacked (omni_arena/tensor_tree.py, TreeEncoder).
LENS = [4, 9, 100, 3, 5, 6, 7, 8, 5]


def _prompts(tmp_path) -> list[dict]:
    rng = np.random.default_rng(15)
    embeds = write_embeds(tmp_path, LENS[:2], 128, seed=15)  # overlays for the first two
    prompts = []
    for i, n in enumerate(LENS):
        ref = tmp_path / f"ref{i}.npy"
        np.save(ref, np.arange(i + 1, dtype=np.float32), allow_pickle=False)
        payload: dict = {"model_intermediate_buffer": {"meta": {"tag": f"r{i}"}, "codes": {"ref": {"npy": str(ref)}}}}
        if i < len(embeds):
            payload["additional_information"] = {"embed": {"prefill": {"npy": embeds[i]}}}
        prompts.append({"token_ids": rng.integers(4, 380, n).tolist(), "payload": payload})
    return prompts


def _job(model: str, prompts: list[dict], log_path, **extra) -> dict:
    return {"model": model, "prompts": prompts, "max_tokens": 8, "register_kwargs_model": True,
            "fetch_outputs": True, "flush": True, "llm_kwargs": {"enable_prefix_caching": False},
            "env": {"OMNI_KWARGS_LOG": str(log_path)}, **extra}


@pytest.mark.slow  # the bench's own check (bench/inproc.py): `make test-slow`
def test_inproc_baseline_matches_the_sidecar(kwargs_model, e2e_dir, tmp_path):
    prompts = _prompts(tmp_path)
    endpoint = f"ipc://{tmp_path}/sc.sock"
    sidecar = SidecarProcess(endpoint, HOOKS, tmp_path / "sidecar.log", options=OPTIONS)
    try:
        via = run_engine(_job(kwargs_model, prompts, tmp_path / "kwargs-sidecar.jsonl", shim=True,
                              endpoint=endpoint), e2e_dir, "inproc-ref-sidecar")
    finally:
        sidecar.stop()
    assert via["ok"], via.get("traceback")
    local = run_engine(_job(kwargs_model, prompts, tmp_path / "kwargs-inproc.jsonl",
                            inproc={"hooks": HOOKS, "options": OPTIONS}), e2e_dir, "inproc-baseline")
    assert local["ok"], local.get("traceback")

    (s_via,), (s_local,) = via["shim_stats"], local["shim_stats"]
    # The sidecar built some steady decode steps' plans ahead (omni_sidecar/sessions/plan_ahead.py), which
    # the comparison below then checks forward by forward against the baseline's (never ahead).
    # Decode steps sent their requests' last rows stacked, checked alike.
    ended = re.findall(r"after (\d+) steps \((\d+) planned ahead, (\d+) tensors sent as stacked rows\)",
                       (tmp_path / "sidecar.log").read_text())
    assert ended and int(ended[-1][0]) == s_via["steps"] and int(ended[-1][1]) > 0, ended  # the engine's session
    assert int(ended[-1][2]) >= len(LENS), ended
    assert s_via["request_errors"] == {} and s_local["request_errors"] == {}
    assert s_local["arena_kind"] == "inproc" and s_local["hook_set"] == HOOKS  # the baseline did run
    assert s_via["arena_kind"] == "shm"
    for key in ("steps", "blocking_exchanges", "new_requests", "finished_requests", "scheduled_tokens"):
        assert s_local[key] == s_via[key], key
    assert s_local["blocking_exchanges"] == s_local["steps"]  # a plan every step, as through the sidecar

    assert local["tokens"] == via["tokens"]
    assert local["request_ids"] == via["request_ids"]
    # The plan as the model saw it, forward by forward: each row's request, span, positions, input
    # ids, a tensor of its state and the state postprocess wrote in the previous step.
    forwards_via = (tmp_path / "kwargs-sidecar.jsonl").read_text().splitlines()
    forwards_local = (tmp_path / "kwargs-inproc.jsonl").read_text().splitlines()
    assert len(forwards_via) == s_via["steps"]
    assert [json.loads(x) for x in forwards_local] == [json.loads(x) for x in forwards_via]
    assert any(len(json.loads(x)) > 1 for x in forwards_via)  # several requests in one forward

    want_names = {"hidden_states", "processed_trace", "hidden_states.layer_0", "hidden_states.layer_1"}
    for rid in via["request_ids"][: len(LENS)]:
        files_via, files_local = via["outputs"][rid], local["outputs"][rid]
        assert set(files_via) == set(files_local) == want_names, rid
        for name in sorted(want_names):
            a = np.load(files_via[name], allow_pickle=False)
            b = np.load(files_local[name], allow_pickle=False)
            assert a.shape == b.shape and a.dtype == b.dtype, (rid, name)
            assert np.array_equal(a, b), f"{rid} {name}: max difference {np.abs(a - b).max()}"
        prompt_and_generated = len(prompts[int(rid)]["token_ids"]) + 8 - 1  # the last sample is never fed back
        assert np.load(files_local["hidden_states"]).shape[0] == prompt_and_generated
