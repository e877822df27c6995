"""A model without KV cache (code2wav) on vLLM 0.26's V2 runner, which cannot take one in two places:
its kernel warm-up divides by the KV blocks a request needs (the real ShimCUDAWorker over upstream's CUDA
worker, whose `compile_or_warm_up_model` is replaced by a fake of 0.26's branch between its V2 and V1
warm-ups), and its block tables assert on a fused writer they build only for two groups or more (the
shim's runner overrides on a fake of 0.26's runner and BlockTables). A CUDA engine cannot start here."""

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


class BlockTablesAs026:
    """vLLM 0.26's V2 `BlockTables`, reduced to what decides `apply_staged_writes`
    (vllm/v1/worker/gpu/block_table.py l.58-63, l.121-131): the fused writer exists for two groups or
    more, and every count but one takes the fused branch, which asserts on it."""

    def __init__(self, block_sizes: list[int]):
        self.num_kv_cache_groups = len(block_sizes)
        self.fused_writer = "fused writer" if self.num_kv_cache_groups > 1 else None
        self.writes: list[str] = []

    def apply_staged_writes(self) -> None:
        if self.num_kv_cache_groups == 1:
            self.writes.append("one table")
        else:
            assert self.fused_writer is not None
            self.writes.append("fused")
        self.writes.append("num_blocks to uva")


class RunnerAs026:
    """The upstream runner's `initialize_kv_cache`: builds its block tables, one group per KV cache group."""

    def __init__(self, groups: list):
        self.groups = groups

    def initialize_kv_cache(self, kv_cache_config):
        self.block_tables = BlockTablesAs026([g.block_size for g in self.groups])
        return "kv cache initialized"


def shim_runner(groups: list):
    from worker_shim.upstream.runner import SidecarRunnerMixin, swap_class

    runner = RunnerAs026(groups)
    swap_class(runner, SidecarRunnerMixin)
    assert runner.initialize_kv_cache("config") == "kv cache initialized"
    return runner


def test_block_tables_without_kv_cache_on_0_26_skip_the_staged_writes(monkeypatch):
    monkeypatch.setattr(compat, "vllm_version", lambda: "0.26.0")
    tables = shim_runner([]).block_tables
    tables.apply_staged_writes()  # upstream's asserts on the fused writer (below)
    assert tables.writes == []
    with pytest.raises(AssertionError):
        BlockTablesAs026([]).apply_staged_writes()


@pytest.mark.parametrize("groups, writes", [([16], ["one table"]), ([16, 32], ["fused"])])
def test_block_tables_with_kv_cache_write_as_upstream(monkeypatch, groups, writes):
    monkeypatch.setattr(compat, "vllm_version", lambda: "0.26.0")
    tables = shim_runner([SimpleNamespace(block_size=b) for b in groups]).block_tables
    assert type(tables) is BlockTablesAs026  # tables with KV cache groups keep upstream's class
    tables.apply_staged_writes()
    assert tables.writes == [*writes, "num_blocks to uva"]


def test_block_tables_stay_upstreams_where_vllm_skips_no_groups(monkeypatch):
    for version in ("0.32.0", "0.33.0.dev1+g1234"):
        monkeypatch.setattr(compat, "vllm_version", lambda: version)
        assert type(shim_runner([]).block_tables) is BlockTablesAs026
