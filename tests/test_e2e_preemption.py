"""Preemption with omni state, end to end: real vLLM V2 (CPU), the shim, a real omni sidecar.

The KV cache holds about two of the four requests at once, so vLLM preempts requests
that carry a prompt-embeds payload, per-request state and hidden-state driven outputs
(the "omni" hook set). Each prompt run alone first (nothing to preempt) gives
the reference: tokens and the sidecar's assembled outputs must not change.
The engine runs once for both tests (about 60 s here).
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.conftest import HIDDEN
from tests.support.procs import ROOT, SidecarProcess, run_engine, write_embeds

pytestmark = pytest.mark.e2e
PROMPT_LENS = [24, 40, 56, 72]
MAX_TOKENS = 40
BLOCK = 32  # tokens per KV block
KV_BLOCKS = 8  # 256 tokens; the four requests need 352 at their longest
KV_BYTES_PER_TOKEN = 2 * 2 * 2 * 32 * 4  # K and V x layers x KV heads x head size x float32


@pytest.fixture(scope="module")
def preempted_run(tiny_model, tmp_path_factory):
    """One engine: each prompt alone, then all four together in a KV cache that holds about two."""
    work = tmp_path_factory.mktemp("preempt")
    files = write_embeds(work, PROMPT_LENS, HIDDEN, seed=5)
    prompts = [
        {"token_ids": [3] * n,
         "payload": {"additional_information": {"embed": {"prefill": {"npy": f}}, "meta": {"source": "stage1"}}}}
        for n, f in zip(PROMPT_LENS, files)
    ]
    endpoint = f"ipc://{work}/sc.sock"
    sidecar = SidecarProcess(endpoint, "omni", work / "sidecar.log")
    try:
        res = run_engine(
            {"model": tiny_model, "prompts": prompts, "max_tokens": MAX_TOKENS, "endpoint": endpoint,
             "llm_kwargs": {"block_size": BLOCK, "max_model_len": 128, "max_num_batched_tokens": 64,
                            "max_num_seqs": 4, "kv_cache_memory_bytes": KV_BLOCKS * BLOCK * KV_BYTES_PER_TOKEN}},
            work, "preempt", script=ROOT / "tests" / "support" / "preempt_job.py",
        )
    finally:
        sidecar.stop()
    assert res["ok"], res.get("traceback")
    return res


def test_preempted_requests_produce_the_same_tokens(preempted_run):
    res = preempted_run
    assert res["alone_preemptions"] == 0
    assert res["together_preemptions"] > 0, "the KV cache was large enough: nothing was preempted"
    (shim,) = res["shim_stats"]
    assert shim["request_errors"] == {}
    alone, together = res["alone"], res["together"]
    assert all(len(t) == MAX_TOKENS for t in together["tokens"])
    assert together["tokens"] == alone["tokens"]


def test_preempted_requests_assemble_the_same_outputs(preempted_run):
    alone, together = preempted_run["alone"], preempted_run["together"]
    for ref, got in zip(alone["outputs"], together["outputs"]):
        assert ref and set(got) == set(ref)
        for name in ref:
            a = np.load(ref[name], allow_pickle=False)
            b = np.load(got[name], allow_pickle=False)
            assert a.shape == b.shape, name
            if np.issubdtype(a.dtype, np.floating):
                np.testing.assert_allclose(b, a, atol=2e-4, rtol=2e-4)
            else:
                assert np.array_equal(a, b), name
