"""The CUDA shim worker's warm-up for a model without KV cache (code2wav) where vLLM's V2 kernel warm-up
divides by the KV blocks a request needs (0.26): the real ShimCUDAWorker over upstream's CUDA worker,
whose `compile_or_warm_up_model` is replaced by a fake of 0.26's branch between its V2 and V1 warm-ups
(a CUDA engine cannot start here)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from worker_shim.upstream import compat


def warm_up_as_026(worker):
    """vLLM 0.26's `Worker.compile_or_warm_up_model`, reduced to what decides the warm-up: with the V2
    flag, `warmup_kernels` caps its batch at (num_blocks - 1) // the KV blocks a request needs
    (vllm/v1/worker/gpu/warmup.py l.214-222); without it, a dummy forward and a sampler run."""
    runner = worker.model_runner
    kv = runner.kv_cache_config
    if worker.use_v2_model_runner:
        blocks_per_request = sum(-(-3 // group.block_size) for group in kv.kv_cache_groups)
        num_reqs = min(8, max(1, (kv.num_blocks - 1) // blocks_per_request))
        runner.warm_ups.append(f"v2: {num_reqs} requests")
    else:
        runner.warm_ups.append("dummy run + sampler")
    return "compilation times"


@pytest.fixture
def worker(monkeypatch):
    from vllm.v1.worker.gpu_worker import Worker

    from worker_shim.upstream.cuda_worker import ShimCUDAWorker

    monkeypatch.setattr(Worker, "compile_or_warm_up_model", warm_up_as_026)

    def make(version: str, groups: list) -> ShimCUDAWorker:
        monkeypatch.setattr(compat, "vllm_version", lambda: version)
        w = object.__new__(ShimCUDAWorker)  # upstream's __init__ wants a whole VllmConfig
        w.use_v2_model_runner = True
        w.model_runner = SimpleNamespace(kv_cache_config=SimpleNamespace(kv_cache_groups=groups, num_blocks=1),
                                         warm_ups=[], omni_refuse_lost_outputs=lambda: None)
        return w

    return make


def test_a_model_without_kv_cache_on_0_26_takes_the_dummy_run_warm_up_and_stays_v2(worker):
    w = worker("0.26.0", [])
    assert w.compile_or_warm_up_model() == "compilation times"
    assert w.model_runner.warm_ups == ["dummy run + sampler"]
    assert w.use_v2_model_runner is True and w.model_runner.omni_warming_up is False


def test_the_v2_warm_up_stays_where_it_can_size_its_batch(worker, monkeypatch):
    from vllm.v1.worker.gpu_worker import Worker

    w = worker("0.26.0", [SimpleNamespace(block_size=16)])  # a KV cache: V2's warm-up as upstream runs it
    w.model_runner.kv_cache_config.num_blocks = 100
    w.compile_or_warm_up_model()
    assert w.model_runner.warm_ups == ["v2: 8 requests"]
    seen = []
    monkeypatch.setattr(Worker, "compile_or_warm_up_model", lambda self: seen.append(self.use_v2_model_runner))
    for version in ("0.28.0", "0.32.0", "0.33.0.dev1+g1234"):  # later minors skip the cap without KV cache
        worker(version, []).compile_or_warm_up_model()
    assert seen == [True, True, True]


def test_the_v2_flag_comes_back_when_the_warm_up_fails(worker, monkeypatch):
    from vllm.v1.worker.gpu_worker import Worker

    def fails(self):
        raise RuntimeError("warm-up failed")

    w = worker("0.26.0", [])
    monkeypatch.setattr(Worker, "compile_or_warm_up_model", fails)
    with pytest.raises(RuntimeError, match="warm-up failed"):
        w.compile_or_warm_up_model()
    assert w.use_v2_model_runner is True
