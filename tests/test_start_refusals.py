"""Configurations the shim would serve wrong are refused at start-up, each with one line saying what
to change: pipeline parallel, a model's own hooks or extra forward kwargs with tensor parallel, a
forward returning outputs under FULL CUDA graphs, one hidden slot (docs/ARCHITECTURE.md, "Platforms").
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from proto.messages import HookNeeds
from worker_shim.config import ShimConfig
from worker_shim.errors import SidecarError
from worker_shim.model.bridge import ModelBridge, find_model_hooks
from worker_shim.step.batch import BatchReader, PayloadTracker
from worker_shim.upstream import worker as worker_mod
from worker_shim.upstream.runner import SidecarRunnerMixin, swap_class
from worker_shim.upstream.compat import model_outputs_refusal, start_refusal, welcome_refusal

CUDAGraphMode = pytest.importorskip("vllm.config").CUDAGraphMode
ENDPOINT = "ipc:///tmp/omni-test-start-refusals.sock"


def vllm_config(tp: int = 1, pp: int = 1, mode=None, slots: int | None = None) -> SimpleNamespace:
    mine = {"endpoint": ENDPOINT, **({"hidden_slots": slots} if slots is not None else {})}
    return SimpleNamespace(
        cache_config=SimpleNamespace(enable_prefix_caching=False),
        compilation_config=SimpleNamespace(cudagraph_mode=mode),
        model_config=SimpleNamespace(dtype=torch.float32, get_hidden_size=lambda: 64, model="m"),
        scheduler_config=SimpleNamespace(max_num_batched_tokens=32),
        parallel_config=SimpleNamespace(world_size=tp * pp, tensor_parallel_size=tp, pipeline_parallel_size=pp),
        additional_config={"omni_sidecar": mine},
    )


def one_line(why: str | None) -> str:
    assert why is not None and "\n" not in why
    return why


# -- before the sidecar is asked (every rank) -------------------------------------------------------


def test_pipeline_parallel_is_refused_whatever_the_hooks():
    for hooks in (False, True):
        why = one_line(start_refusal(vllm_config(pp=2), hooks))
        assert "pipeline parallel size 1" in why and "--pipeline-parallel-size 1" in why


def test_a_model_with_its_own_hooks_is_refused_with_tensor_parallel():
    why = one_line(start_refusal(vllm_config(tp=2), True))
    assert "vllm-omni hooks" in why and "--tensor-parallel-size 1" in why
    assert start_refusal(vllm_config(tp=2), False) is None  # plain models run with TP (rank 0 drives)
    assert start_refusal(vllm_config(), True) is None


class _UpstreamWorker:
    built: list[bool]

    def init_device(self) -> None:
        self.built.append(True)


def _init_device(monkeypatch, cfg, class_has_hooks: bool) -> tuple[list[bool], list[bool], str]:
    """ShimWorkerMixin.init_device up to upstream's own: (upstream built, hooks looked up, why it stopped)."""
    looked: list[bool] = []
    monkeypatch.setattr(worker_mod, "check_upstream", lambda platform: None)
    monkeypatch.setattr(worker_mod, "model_class_has_hooks", lambda c: looked.append(True) or class_has_hooks)
    worker = type("Worker", (worker_mod.ShimWorkerMixin, _UpstreamWorker), {})()
    worker.vllm_config, worker.built = cfg, []
    worker.use_v2_model_runner = False  # past upstream's init_device the V1 refusal stops the fake
    with pytest.raises(SidecarError) as err:
        worker.init_device()
    return worker.built, looked, str(err.value)


def test_the_worker_refuses_pipeline_parallel_before_upstream_builds_anything(monkeypatch):
    built, _, why = _init_device(monkeypatch, vllm_config(pp=2), False)
    assert built == [] and "--pipeline-parallel-size 1" in why


def test_the_worker_refuses_a_hooked_model_class_with_tensor_parallel_on_every_rank(monkeypatch):
    built, looked, why = _init_device(monkeypatch, vllm_config(tp=2), True)
    assert built == [] and looked == [True] and "--tensor-parallel-size 1" in why


def test_with_tensor_parallel_1_the_model_class_is_not_looked_up_at_device_start(monkeypatch):
    built, looked, why = _init_device(monkeypatch, vllm_config(), True)
    assert built == [True] and looked == [] and "Model Runner V2 only" in why  # the fake's own stop


# -- once the sidecar's Welcome says what the hooks need ----------------------------------------------


KWARGS = HookNeeds(pre_forward="always", extra_kwargs=True)


def test_extra_kwargs_are_refused_with_tensor_parallel():
    why = one_line(welcome_refusal(KWARGS, "omni", vllm_config(tp=2)))
    assert "extra forward kwargs" in why and "tensor parallel size 2" in why and "--tensor-parallel-size 1" in why
    assert welcome_refusal(KWARGS, "omni", vllm_config()) is None
    overlay = HookNeeds(pre_forward="prefill", hidden_states=True)  # rank 0 broadcasts overlay rows
    assert welcome_refusal(overlay, "overlay", vllm_config(tp=2)) is None


class _Connection:
    """Stands in for SidecarConnection: its Welcome carries the extra-kwargs needs."""

    closed = 0

    def __init__(self, *args, **kwargs) -> None:
        pass

    def connect(self, timeout_s):
        return SimpleNamespace(needs=KWARGS, hook_set="omni", sidecar_version="t", session=1)

    def close(self) -> None:
        type(self).closed += 1


def test_rank_0_refuses_extra_kwargs_with_tensor_parallel_and_closes_its_connection(monkeypatch):
    monkeypatch.setattr(worker_mod, "SidecarConnection", _Connection)
    monkeypatch.setattr(worker_mod, "SidecarLink", lambda *a, **k: "linked")
    monkeypatch.setattr(worker_mod, "sweep_stale", lambda: [])
    fake = SimpleNamespace(vllm_config=vllm_config(tp=2), rank=0, omni_platform="cpu", device="cpu")
    fake._arena_choice = lambda setting: (torch.device("cpu"), "shm")
    _Connection.closed = 0
    with pytest.raises(SidecarError, match="tensor parallel size 2"):
        worker_mod.ShimWorkerMixin._connect_sidecar(fake, PayloadTracker(), BatchReader())
    assert _Connection.closed == 1


# -- a forward that returns outputs, under FULL CUDA graphs ---------------------------------------------


@pytest.mark.parametrize("mode", ["FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE"])
def test_outputs_of_the_forward_under_full_graphs_are_refused(mode):
    why = one_line(model_outputs_refusal(vllm_config(mode=CUDAGraphMode[mode])))
    assert "forward returns outputs" in why and mode in why and "PIECEWISE" in why and "--enforce-eager" in why


@pytest.mark.parametrize("mode", ["NONE", "PIECEWISE", None])
def test_outputs_of_the_forward_without_full_graphs_start(mode):
    assert model_outputs_refusal(vllm_config(mode=None if mode is None else CUDAGraphMode[mode])) is None


class _HookedModel(torch.nn.Module):
    """A model with vllm-omni's postprocess hook whose forward returns (hidden, extra) when it
    `returns_outputs` (in vLLM's warm-up runs already, or only once it serves a request), else hidden."""

    has_postprocess = True

    def __init__(self, returns_outputs: bool, in_warm_up: bool = True) -> None:
        super().__init__()
        self.returns_outputs, self.in_warm_up, self.serving = returns_outputs, in_warm_up, False

    def postprocess(self, hidden, **info):
        return {}

    def forward(self, x):
        outputs = self.returns_outputs and (self.in_warm_up or self.serving)
        return (x, x * 2) if outputs else x


class _UpstreamRunner:
    """What the shim's runner overrides read of upstream's: a step runs the model's forward."""

    def __init__(self, model: _HookedModel, mode: str) -> None:
        self.model, self.vllm_config = model, vllm_config(mode=CUDAGraphMode[mode])
        self.execute_model_state = None

    def execute_model(self, scheduler_output, *args, **kwargs):
        hidden = self.model(torch.ones(2, 3))
        batch = SimpleNamespace(req_ids=["a"], query_start_loc_np=np.array([0, 2]),
                                num_computed_tokens_np=np.array([0]))
        self.execute_model_state = SimpleNamespace(input_batch=batch, hidden_states=hidden)


class _Link:
    """The runner's link, as a step uses it (no sidecar)."""

    def __init__(self) -> None:
        self.ended = 0
        self.results = None

    def begin_step(self) -> None:
        pass

    def note_model_errors(self, errors) -> None:
        pass

    def end_step(self, state, results=None) -> None:
        self.ended += 1
        self.results = results


def _runner(mode: str, returns_outputs: bool, in_warm_up: bool = True):
    model = _HookedModel(returns_outputs, in_warm_up)
    runner = _UpstreamRunner(model, mode)
    swap_class(runner, SidecarRunnerMixin)
    runner.omni_bridge = ModelBridge(model, find_model_hooks(model))
    runner.omni_bridge.note_new("a", 2)
    runner.omni_bridge.fill_states({"a": {}}, failed=set())  # the sidecar's state for it, as a plan brings it
    runner.omni_link = _Link()
    return runner


def _warm_up(runner, profiled: bool) -> None:
    """The worker's compile_or_warm_up_model over an upstream one that calls the forward as graph
    capture does (`profiled`: vLLM's profile run called it before)."""
    if profiled:
        runner.model(torch.ones(2, 3))

    class UpstreamWorker:
        def compile_or_warm_up_model(self):
            runner.model(torch.ones(2, 3))  # the capture's forward
            return "compilation times"

    worker = type("Worker", (worker_mod.ShimWorkerMixin, UpstreamWorker), {})()
    worker.model_runner = runner
    assert worker.compile_or_warm_up_model() == "compilation times"


@pytest.mark.parametrize("profiled", [True, False])
def test_the_worker_refuses_a_forward_returning_outputs_under_full_graphs(profiled):
    with pytest.raises(SidecarError, match="FULL CUDA graph replay would not return"):
        _warm_up(_runner("FULL_AND_PIECEWISE", True), profiled)


def test_the_worker_serves_a_forward_returning_outputs_under_piecewise_graphs():
    runner = _runner("PIECEWISE", True)
    _warm_up(runner, True)
    assert runner.omni_bridge.forward_returns_outputs and runner.omni_warming_up is False
    runner.execute_model(SimpleNamespace())
    updates, outputs = runner.omni_link.results
    assert runner.omni_link.ended == 1 and "model_output" in outputs["a"]  # the forward's extra, as an output


def test_the_worker_keeps_full_graphs_for_a_hooked_model_whose_forward_returns_a_tensor():
    runner = _runner("FULL_AND_PIECEWISE", False)
    _warm_up(runner, True)
    runner.execute_model(SimpleNamespace())
    assert runner.omni_bridge.forward_returns_outputs is False and runner.omni_link.ended == 1


def test_outputs_first_returned_by_a_real_step_under_full_graphs_stop_that_step():
    """A forward that returns outputs only for real requests passed the warm-up runs: the first
    step whose forward returns them stops the engine with the same line, before its StepEnd."""
    runner = _runner("FULL_DECODE_ONLY", True, in_warm_up=False)
    _warm_up(runner, True)
    runner.model.serving = True
    with pytest.raises(SidecarError, match="FULL CUDA graph replay would not return"):
        runner.execute_model(SimpleNamespace())
    assert runner.omni_link.ended == 0


# -- the shim's own settings ---------------------------------------------------------------------------


def test_one_hidden_slot_is_refused():
    with pytest.raises(ValueError, match="hidden_slots 1: use 2 or more"):
        ShimConfig.from_vllm(vllm_config(slots=1))
    assert ShimConfig.from_vllm(vllm_config(slots=3)).hidden_slots == 3
    assert ShimConfig.from_vllm(vllm_config()).hidden_slots == 2
