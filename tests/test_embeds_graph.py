"""The embeds buffer's lookup replayed from CUDA graphs of our own (worker_shim/model/embeds.py).

The CUDA checks run on a GPU host (`python -m pytest tests/test_embeds_graph.py` there); on CPU
they are reported as skipped, never as passed. The CPU checks say where no graph is made.
"""

from __future__ import annotations

import enum
import logging
from types import SimpleNamespace

import pytest
import torch

from worker_shim.upstream.compat import graph_sizes
from worker_shim.model.embeds import EmbedsBuffer

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run on the GPU host)")


class Embedder(torch.nn.Module):
    """A model's `embed_input_ids` as vLLM's embedding runs it: int32 ids cast, looked up, scaled."""

    def __init__(self, vocab: int, width: int, device: torch.device) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.table = torch.nn.Embedding(vocab, width, device=device)

    def embed_input_ids(self, ids: torch.Tensor) -> torch.Tensor:
        return self.table(ids.long()) * 2.0


class Syncing(Embedder):
    """A lookup that reads a value on the host: no graph can hold it."""

    def embed_input_ids(self, ids: torch.Tensor) -> torch.Tensor:
        if int(ids.max()) < 0:
            raise AssertionError("unreachable")
        return super().embed_input_ids(ids)


class Mode(enum.Enum):
    NONE = 0
    PIECEWISE = 1


def test_graph_sizes_are_vllms_capture_sizes_only_where_it_runs_graphs():
    config = SimpleNamespace(compilation_config=SimpleNamespace(cudagraph_mode=Mode.PIECEWISE,
                                                                cudagraph_capture_sizes=[8, 1, 2, 8]))
    assert graph_sizes(config) == [1, 2, 8]
    config.compilation_config.cudagraph_mode = Mode.NONE  # enforce_eager
    assert graph_sizes(config) == []
    assert graph_sizes(SimpleNamespace()) == []  # a vLLM without the fields: eager


def test_on_the_host_every_fill_is_eager():
    model = Embedder(32, 4, torch.device("cpu"))
    buffer = EmbedsBuffer(16, 4, torch.float32, torch.device("cpu"), graph_sizes=[4, 8])
    ids = torch.arange(16, dtype=torch.int32)
    for _ in range(3):
        assert torch.equal(buffer.fill(model, ids, 8), model.embed_input_ids(ids[:8]))
    assert buffer.graph_replays == 0


@CUDA
def test_the_lookup_replays_from_a_graph_of_each_size_and_equals_the_eager_one():
    dev = torch.device("cuda", 0)
    model = Embedder(384, 64, dev)
    buffer = EmbedsBuffer(64, 64, torch.float32, dev, graph_sizes=[4, 16])
    ids = torch.zeros(64, dtype=torch.int32, device=dev)  # vLLM's persistent input_ids buffer
    gen = torch.Generator(device=dev).manual_seed(1)
    for step in range(8):
        n = (4, 16, 7)[step % 3]  # 7: no graph of that size, eager
        ids.random_(0, 384, generator=gen)
        got = buffer.fill(model, ids, n)
        torch.cuda.synchronize(dev)
        assert torch.equal(got, model.embed_input_ids(ids[:n])), (step, n)
    assert buffer.graph_replays == 4  # sizes 4 and 16, each captured at its first step, replayed after
    elsewhere = ids.clone()  # input_ids not where the graph reads them: eager, still right
    assert torch.equal(buffer.fill(model, elsewhere, 4), model.embed_input_ids(elsewhere[:4]))
    assert buffer.graph_replays == 4


@CUDA
def test_a_lookup_no_graph_can_hold_runs_eagerly_and_says_so_once(caplog):
    dev = torch.device("cuda", 0)
    model = Syncing(384, 64, dev)
    buffer = EmbedsBuffer(64, 64, torch.float32, dev, graph_sizes=[4, 16])
    ids = torch.randint(0, 384, (64,), dtype=torch.int32, device=dev)
    with caplog.at_level(logging.WARNING, logger="vllm.omni_sidecar.shim.embeds"):
        for n in (4, 4, 16, 16):
            assert torch.equal(buffer.fill(model, ids, n), model.embed_input_ids(ids[:n]))
    assert buffer.graph_replays == 0
    assert len([r for r in caplog.records if "could not be captured" in r.message]) == 1
    torch.cuda.synchronize(dev)  # the failed capture left the device usable
    # ... and its random generator: vLLM samples with it (before the fix: "Offset increment outside
    # graph capture encountered unexpectedly" until the cycle collector destroyed the graph)
    assert torch.randn(8, device=dev).isfinite().all()
    # ... and a later capture of another buffer works and replays
    good = EmbedsBuffer(64, 64, torch.float32, dev, graph_sizes=[4])
    plain = Embedder(384, 64, dev)
    for _ in range(3):
        assert torch.equal(good.fill(plain, ids, 4), plain.embed_input_ids(ids[:4]))
    assert good.graph_replays == 2
