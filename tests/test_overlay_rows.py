"""A prefill step's overlay rows written by the sidecar in one concatenation (omni_sidecar/arenas.py,
`OutArena.put_rows`): each request's rows a run of it, read back as they were sent."""

from __future__ import annotations

import pytest
import torch

from omni_arena.views import arena_tensor
from omni_sidecar.arenas import OutArena, SessionArenas
from omni_sidecar.metrics import SidecarMetrics
from proto.arena import ALIGN, ShmArena
from proto.messages import Hello
from tests.support.arenas import DeviceLikeArena


def _rows(counts, width=8, dtype=torch.bfloat16):
    gen = torch.Generator().manual_seed(3)
    return [torch.randn(k, width, generator=gen).to(dtype) for k in counts]


def _read(arena, ref):
    if isinstance(arena, DeviceLikeArena):
        return arena.buf[ref.offset : ref.offset + ref.nbytes].view(torch.bfloat16).view(ref.shape)
    return arena_tensor(arena, ref)


@pytest.mark.parametrize("kind", ["shm", "device"])
def test_rows_go_back_to_back_in_one_write_and_read_back_as_sent(kind):
    arena = ShmArena.create(1 << 16, prefix="omni-test-rows") if kind == "shm" else DeviceLikeArena(1 << 16)
    try:
        out = OutArena(arena)
        out.put(torch.ones(3))  # something before: the rows start at an aligned offset past it
        rows = _rows([16, 5, 0, 16])
        rows[1] = rows[1].t().contiguous().t()  # a non-contiguous source is written by value
        staged, calls = out._staged, []
        out._staged = lambda end: calls.append(end) or staged(end)
        refs = out.put_rows(rows)
        assert len(calls) == (1 if kind == "device" else 0)  # one staging write for all the rows
        out.seal()
        assert refs[0].offset % ALIGN == 0
        assert [r.offset for r in refs[1:]] == [refs[0].offset + sum(t.nbytes for t in rows[:i]) for i in range(1, 4)]
        for ref, sent in zip(refs, rows):
            assert ref.shape == list(sent.shape) and ref.dtype == "bfloat16"
            assert torch.equal(_read(arena, ref), sent)
        assert out.offset % ALIGN == 0 and out.offset >= refs[-1].offset + refs[-1].nbytes
    finally:
        if kind == "shm":
            arena.close()


def _session_arenas(arena) -> SessionArenas:
    hello = Hello(1, 8, "test", "none", "cpu", 0, 1, "m", 8, "bfloat16", 64, [])
    arenas = SessionArenas(1, hello, SidecarMetrics())
    arenas.out = OutArena(arena)
    return arenas


def test_a_steps_overlays_are_one_write_when_their_rows_match_and_one_each_otherwise(monkeypatch):
    arena = DeviceLikeArena(1 << 16)
    arenas = _session_arenas(arena)
    calls = {"rows": 0, "put": 0}
    put_rows, put = arenas.out.put_rows, arenas.out.put
    monkeypatch.setattr(arenas.out, "put_rows", lambda ts: calls.__setitem__("rows", calls["rows"] + 1) or put_rows(ts))
    monkeypatch.setattr(arenas.out, "put", lambda t: calls.__setitem__("put", calls["put"] + 1) or put(t))
    same = _rows([4, 2, 3], dtype=torch.float32)  # converted to the shim's dtype (bfloat16) on the way
    overlays = arenas.write_overlays([(0, same[0]), (4, same[1]), (9, same[2])])
    assert calls == {"rows": 1, "put": 0}
    arenas.out.seal()
    assert [o.row_start for o in overlays] == [0, 4, 9]
    for o, sent in zip(overlays, same):
        assert torch.equal(_read(arena, o.rows), sent.to(torch.bfloat16))
    odd = [torch.ones(2, 8), torch.ones(2, 4)]  # rows of another width: each its own write
    arenas.write_overlays([(0, odd[0]), (2, odd[1])])
    assert calls == {"rows": 1, "put": 2}
    with pytest.raises(ValueError, match="one dtype, device and row shape"):
        put_rows(odd)
