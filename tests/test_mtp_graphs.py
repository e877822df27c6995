"""A model's talker_mtp replayed from CUDA graphs of the shim's own (worker_shim/model/mtp_graphs.py).

The CUDA checks run on a GPU host (deploy/gpu/run_parity.sh runs this file there); on CPU they are
reported as skipped, never as passed. The CPU checks say where no graph is made.
"""

from __future__ import annotations

import enum
import logging
from types import SimpleNamespace

import pytest
import torch

from worker_shim.model.mtp_graphs import TalkerMtpGraphs
from worker_shim.upstream.compat import full_graph_sizes

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run on the GPU host)")
Q = 4  # code groups: code 0 from the talker, Q-1 residual codes predicted one after another
H = 32


class Predictor(torch.nn.Module):
    """A code predictor's shape: Q-1 autoregressive steps of a matmul, argmax (or a sampled pick),
    an embedding of the pick; returns the next inputs_embeds rows and the codes [B, Q]."""

    def __init__(self, device: torch.device, syncing: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.proj = torch.nn.Linear(H, 64, device=device)
        self.embed = torch.nn.Embedding(64, H, device=device)
        self.syncing = syncing
        self.calls = 0

    @torch.inference_mode()
    def talker_mtp(self, ids, embeds, last_hidden, text_step, do_sample=False, **_):
        self.calls += 1
        x = embeds + last_hidden
        codes = [ids.reshape(-1, 1).long()]
        for _ in range(Q - 1):
            logits = self.proj(x).float()
            if do_sample:
                noise = torch.empty_like(logits).uniform_(1e-6, 1 - 1e-6)
                pick = (logits - torch.log(-torch.log(noise))).argmax(-1, keepdim=True)
            else:
                pick = logits.argmax(-1, keepdim=True)
            if self.syncing and int(pick.max()) < 0:
                raise AssertionError("unreachable")
            codes.append(pick)
            x = x + self.embed(pick.squeeze(-1))
        return x + text_step, torch.cat(codes, dim=1)


def inputs(n: int, device: torch.device, seed: int):
    g = torch.Generator(device=device).manual_seed(seed)
    return (torch.randint(0, 64, (n,), dtype=torch.int32, device=device, generator=g),
            torch.randn(n, H, device=device, generator=g), torch.randn(n, H, device=device, generator=g),
            torch.randn(n, H, device=device, generator=g))


class Mode(enum.Enum):
    NONE = 0
    PIECEWISE = 1
    FULL_AND_PIECEWISE = 2

    def has_full_cudagraphs(self) -> bool:
        return "FULL" in self.name


def test_sizes_only_where_vllm_runs_full_graphs():
    config = SimpleNamespace(compilation_config=SimpleNamespace(cudagraph_mode=Mode.FULL_AND_PIECEWISE,
                                                                cudagraph_capture_sizes=[8, 1, 2, 8]))
    assert full_graph_sizes(config) == [1, 2, 8]
    config.compilation_config.cudagraph_mode = Mode.PIECEWISE  # vllm-omni keeps talker_mtp eager then
    assert full_graph_sizes(config) == []
    config.compilation_config.cudagraph_mode = Mode.NONE
    assert full_graph_sizes(config) == []


def test_on_the_host_every_call_is_eager_and_unpadded():
    model = Predictor(torch.device("cpu"))
    graphs = TalkerMtpGraphs(model.talker_mtp, {}, [4, 8], torch.device("cpu"))
    for n in (3, 8):
        args = inputs(n, torch.device("cpu"), n)
        got, want = graphs(*args), model.talker_mtp(*args)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert graphs.graph_replays == 0 and graphs.padded(3) is None


@CUDA
def test_each_size_replays_from_a_graph_and_equals_the_eager_padded_call():
    dev = torch.device("cuda", 0)
    model = Predictor(dev)
    graphs = TalkerMtpGraphs(model.talker_mtp, {}, [2, 4, 8], dev)
    for step, n in enumerate((3, 3, 8, 5, 1, 8, 12)):  # 12: over the largest size, eager unpadded
        args = inputs(n, dev, step)
        got_embeds, got_codes = graphs(*args)
        want_embeds, want_codes = model.talker_mtp(*args)
        torch.cuda.synchronize(dev)
        assert got_codes.shape == (n, Q) and got_embeds.shape == (n, H), (step, n)
        assert torch.equal(got_codes, want_codes), (step, n)  # rows are independent: padding changes nothing
        assert torch.allclose(got_embeds, want_embeds, atol=1e-5), (step, n)
    assert graphs.graph_replays == 3  # sizes 4 (n=3, then 3 again), 8 (n=8, 5, 8), 2 (n=1): first calls capture


@CUDA
def test_sampling_inside_the_graph_draws_new_numbers_each_replay():
    dev = torch.device("cuda", 0)
    model = Predictor(dev)
    graphs = TalkerMtpGraphs(model.talker_mtp, {"do_sample": True}, [8], dev)
    args = inputs(8, dev, 0)
    draws = [graphs(*args)[1].clone() for _ in range(4)]
    torch.cuda.synchronize(dev)
    assert graphs.graph_replays == 3
    assert all(((d >= 0) & (d < 64)).all() for d in draws)
    assert any(not torch.equal(draws[1], d) for d in draws[2:])  # the generator's offset advances per replay


@CUDA
def test_a_talker_mtp_no_graph_can_hold_runs_eagerly_and_says_so_once(caplog):
    dev = torch.device("cuda", 0)
    model = Predictor(dev, syncing=True)
    graphs = TalkerMtpGraphs(model.talker_mtp, {}, [4, 8], dev)
    with caplog.at_level(logging.WARNING, logger="vllm.omni_sidecar.shim.mtp_graphs"):
        for n in (4, 4, 8, 8):
            args = inputs(n, dev, n)
            got = graphs(*args)
            want = model.talker_mtp(*args)
            assert torch.equal(got[1], want[1])
    assert graphs.graph_replays == 0
    assert len([r for r in caplog.records if "could not be captured" in r.message]) == 1
    torch.cuda.synchronize(dev)
    assert torch.randn(8, device=dev).isfinite().all()  # the device and its generator stay usable
