"""The omni hook set end to end: real vLLM V2 (CPU), the shim, real sidecar processes."""

from __future__ import annotations

import json
import threading

import numpy as np
import pytest
import torch

from tests.conftest import EMBEDS_LENS
from tests.support.procs import SidecarProcess, run_engine

pytestmark = pytest.mark.e2e


def test_extra_kwargs_state_and_assembled_outputs(kwargs_model, tiny_model, e2e_dir, tmp_path):
    from omni_sidecar.client import SidecarClient
    from transformers import LlamaForCausalLM

    rng = np.random.default_rng(11)
    lens = [4, 9, 100]  # the 100-token prompt prefills in chunks next to the others' decodes
    prompts = []
    for i, n in enumerate(lens):
        ref = tmp_path / f"ref{i}.npy"
        np.save(ref, np.arange(i + 1, dtype=np.float32), allow_pickle=False)
        prompts.append({
            "token_ids": rng.integers(4, 380, n).tolist(),
            "payload": {"model_intermediate_buffer": {"meta": {"tag": f"r{i}"}, "codes": {"ref": {"npy": str(ref)}}}},
        })
    log_path = tmp_path / "kwargs.jsonl"
    endpoint = f"ipc://{tmp_path}/sc.sock"
    sidecar = SidecarProcess(endpoint, "omni", tmp_path / "sidecar.log", options=["extra_kwargs=1"])
    streamed: list[dict] = []

    def follow() -> None:  # a client streaming request "2" while the engine runs
        with SidecarClient(endpoint) as client:
            streamed.extend(client.stream("2", timeout_s=300))

    follower = threading.Thread(target=follow, daemon=True)
    follower.start()
    try:
        res = run_engine(
            {"model": kwargs_model, "prompts": prompts, "max_tokens": 8, "shim": True,
             "endpoint": endpoint, "register_kwargs_model": True, "fetch_outputs": True, "flush": True,
             "llm_kwargs": {"enable_prefix_caching": False}, "env": {"OMNI_KWARGS_LOG": str(log_path)}},
            e2e_dir, "omni-kwargs",
        )
        follower.join(60)
    finally:
        sidecar.stop()
    assert res["ok"], res.get("traceback")
    (shim,) = res["shim_stats"]
    assert shim["request_errors"] == {}
    assert shim["blocking_exchanges"] == shim["steps"]  # pre_forward="always" with extra kwargs
    # Each StepBegin went from the runner's prepare_inputs, its plan taken after vLLM's attention metadata.
    assert shim["asked_early"] == shim["blocking_exchanges"]

    full = {f"r{i}": p + o for i, (p, o) in enumerate(zip(res["prompt_token_ids"], res["tokens"]))}
    forwards = [json.loads(line) for line in log_path.read_text().splitlines()]
    assert len(forwards) == shim["steps"]  # the flush request's step has no payload tag, still logged
    mixed = 0
    for rows in forwards:
        lengths = set()
        for row in rows:
            if row["tag"] is None:
                continue  # the flush request
            start, end = row["span"]
            pos = row["position"]
            # Row i's dict belongs to the request whose tokens sit in row i's span.
            assert row["input_ids"] == full[row["tag"]][pos : pos + end - start]
            assert row["ref_sum"] == sum(range(int(row["tag"][1:]) + 1))
            # State written by postprocess at step t is what the forward of step t+1 sees.
            assert row["processed"] == pos
            lengths.add(end - start > 1)
        mixed += lengths == {True, False}
    assert mixed >= 1, "no step mixed a prefill chunk with decodes"

    model = LlamaForCausalLM.from_pretrained(tiny_model, torch_dtype=torch.float32).eval()
    for rid, tag in zip(res["request_ids"], full):
        ids = full[tag][:-1]
        hidden = torch.from_numpy(np.load(res["outputs"][rid]["hidden_states"], allow_pickle=False))
        trace = np.load(res["outputs"][rid]["processed_trace"], allow_pickle=False)
        with torch.no_grad():
            direct = model.model(torch.tensor([ids])).last_hidden_state[0]
        torch.testing.assert_close(hidden, direct, atol=2e-4, rtol=2e-4)
        assert trace[:, 0].tolist() == np.concatenate([[0], np.cumsum(trace[:, 1])[:-1]]).tolist()
        assert trace[:, 1].sum() == len(ids)
    # Streaming delivered the same rows, step by step, before the end.
    assert len(streamed) > 2
    stream_hidden = torch.cat([c["hidden_states"] for c in streamed])
    torch.testing.assert_close(
        stream_hidden, torch.from_numpy(np.load(res["outputs"]["2"]["hidden_states"], allow_pickle=False))
    )


def test_omni_payload_overlay(tiny_model, e2e_dir, embeds_case, tmp_path):
    """vllm-omni payload (`embed.prefill`) -> overlay: the same tokens as prompt_embeds."""
    endpoint = f"ipc://{tmp_path}/sc.sock"
    sidecar = SidecarProcess(endpoint, "omni", tmp_path / "sidecar.log")
    prompts = [
        {"token_ids": [3] * n,
         "payload": {"additional_information": {"embed": {"prefill": {"npy": f}}, "meta": {"source": "stage1"}}}}
        for n, f in zip(EMBEDS_LENS, embeds_case["files"])
    ]
    try:
        res = run_engine(
            {"model": tiny_model, "prompts": prompts, "max_tokens": 16, "shim": True, "endpoint": endpoint,
             "llm_kwargs": {"enable_prefix_caching": False}},
            e2e_dir, "omni-overlay",
        )
    finally:
        sidecar.stop()
    assert res["ok"], res.get("traceback")
    assert res["shim_stats"][0]["request_errors"] == {}
    assert res["tokens"] == embeds_case["tokens"]  # overlay through the omni payload path
