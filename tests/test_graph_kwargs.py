"""Extra forward kwargs under FULL CUDA graphs: the shim refuses the combination at start-up.

A FULL graph replays what it captured without calling the model, so kwargs would be dropped
without a word (docs/ARCHITECTURE.md, "Extra kwargs and CUDA graphs").
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from proto.messages import HookNeeds
from worker_shim.upstream import worker as worker_mod
from worker_shim.step.batch import BatchReader, PayloadTracker
from worker_shim.errors import SidecarError
from worker_shim.upstream.compat import full_cuda_graphs, welcome_refusal

CUDAGraphMode = pytest.importorskip("vllm.config").CUDAGraphMode


def vllm_config(mode, prefix_caching: bool = False) -> SimpleNamespace:
    return SimpleNamespace(
        cache_config=SimpleNamespace(enable_prefix_caching=prefix_caching),
        compilation_config=SimpleNamespace(cudagraph_mode=mode),
        model_config=SimpleNamespace(dtype=torch.float32, get_hidden_size=lambda: 64, model="m"),
        scheduler_config=SimpleNamespace(max_num_batched_tokens=32),
        parallel_config=SimpleNamespace(world_size=1),
        additional_config={"omni_sidecar": {"endpoint": "ipc:///tmp/omni-test-graph-kwargs.sock"}},
    )


KWARGS = HookNeeds(pre_forward="always", extra_kwargs=True)


@pytest.mark.parametrize("mode", ["FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE"])
def test_extra_kwargs_with_full_graphs_are_refused_in_one_line(mode):
    why = welcome_refusal(KWARGS, "omni", vllm_config(CUDAGraphMode[mode]))
    assert why is not None and "\n" not in why
    assert "extra forward kwargs" in why and mode in why and "PIECEWISE" in why and "--enforce-eager" in why


@pytest.mark.parametrize("mode", ["NONE", "PIECEWISE", None])
def test_extra_kwargs_without_full_graphs_start(mode):
    cfg = vllm_config(None if mode is None else CUDAGraphMode[mode])
    assert welcome_refusal(KWARGS, "omni", cfg) is None
    assert not full_cuda_graphs(cfg.compilation_config.cudagraph_mode)


def test_hooks_without_extra_kwargs_keep_full_graphs():
    needs = HookNeeds(pre_forward="prefill", hidden_states=True)
    assert welcome_refusal(needs, "overlay", vllm_config(CUDAGraphMode.FULL_AND_PIECEWISE)) is None


def test_prefix_caching_refusal_still_comes_first():
    needs = HookNeeds(pre_forward="prefill", prefix_cache_safe=False, extra_kwargs=True)
    why = welcome_refusal(needs, "omni", vllm_config(CUDAGraphMode.FULL, prefix_caching=True))
    assert "prefix caching" in why


def test_the_omni_hook_set_declares_its_extra_kwargs():
    from omni_sidecar.hook_sets.omni.state_hooks import OmniStateHooks

    assert OmniStateHooks(extra_kwargs="1").needs.extra_kwargs is True
    assert OmniStateHooks().needs.extra_kwargs is False


class _Connection:
    """Stands in for SidecarConnection: its Welcome carries the given needs."""

    needs = KWARGS
    closed = 0

    def __init__(self, *args, **kwargs) -> None:
        pass

    def connect(self, timeout_s):
        return SimpleNamespace(needs=self.needs, hook_set="omni", sidecar_version="t", session=1)

    def close(self) -> None:
        type(self).closed += 1


def _connect(monkeypatch, mode):
    """The worker's own start-up path (ShimWorkerMixin._connect_sidecar) with a fake sidecar."""
    monkeypatch.setattr(worker_mod, "SidecarConnection", _Connection)
    monkeypatch.setattr(worker_mod, "SidecarLink", lambda *a, **k: "linked")
    monkeypatch.setattr(worker_mod, "sweep_stale", lambda: [])
    fake = SimpleNamespace(vllm_config=vllm_config(mode), rank=0, omni_platform="cpu", device="cpu")
    fake._arena_choice = lambda setting: (torch.device("cpu"), "shm")
    return worker_mod.ShimWorkerMixin._connect_sidecar(fake, PayloadTracker(), BatchReader())


def test_the_worker_refuses_to_start_with_kwargs_under_full_graphs(monkeypatch):
    _Connection.closed = 0
    with pytest.raises(SidecarError, match="FULL CUDA graph replay would drop"):
        _connect(monkeypatch, CUDAGraphMode.FULL_AND_PIECEWISE)
    assert _Connection.closed == 1  # the connection it opened is closed again


def test_the_worker_starts_with_kwargs_under_piecewise_graphs(monkeypatch):
    assert _connect(monkeypatch, CUDAGraphMode.PIECEWISE) == "linked"
