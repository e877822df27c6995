"""A prefill step's overlay rows written by the sidecar in one concatenation (omni_sidecar/sessions/arenas.py,
`OutArena.put_rows`): each request's rows a run of it, read back as they were sent."""

from __future__ import annotations

import pytest
import torch

from omni_arena.views import arena_tensor
from omni_sidecar.sessions.arenas import OutArena, SessionArenas
from omni_sidecar.serve.metrics import SidecarMetrics
from proto.arena import ALIGN, ShmArena
from proto.messages import Hello
from proto.version import PROTOCOL_MAJOR
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
    hello = Hello(PROTOCOL_MAJOR, 0, "test", "none", "cpu", 0, 1, "m", 8, "bfloat16", 64, [])
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


class _SlotArena:
    """A device arena of the shim's slots over host bytes, counting the ready waits and done marks."""

    kind = "fake-device"

    def __init__(self, size: int) -> None:
        self.size = size
        self.buf = torch.zeros(size, dtype=torch.uint8)
        self.waits: list[int] = []
        self.done: list[int] = []

    def view(self, ref):  # what `arena_tensor` reads a non-CUDA arena's bytes through
        return memoryview(self.buf.numpy())[ref.offset : ref.offset + ref.nbytes]

    def wait_ready(self, slot: int) -> None:
        self.waits.append(slot)

    def mark_done(self, slot: int) -> None:
        self.done.append(slot)


def test_a_step_end_waits_once_for_its_slot_whatever_it_reads():
    """The hidden rows and each captured layer share the StepEnd's ready event: one wait on our
    stream a StepEnd (a wait each was a stream look-up and a wait each); the next StepEnd waits again."""
    from proto.messages import StepEnd
    from proto.tensors import TensorRef

    arenas = _session_arenas(DeviceLikeArena(1 << 12))
    slot = _SlotArena(1 << 12)
    arenas.inputs, arenas.wanted_layers = [slot], [0, 2]
    ref = lambda k: TensorRef(0, 256 * k, 32, [1, 8], "float32")  # noqa: E731
    for step, event in ((0, 0), (1, 1)):
        msg = StepEnd(step, None, hidden=ref(0), hidden_layers={0: ref(1), 2: ref(2)}, hidden_event=event, num_tokens=1)
        assert arenas.hidden(msg).shape == (1, 8) and set(arenas.hidden_layers(msg)) == {0, 2}
        arenas.release_slot(msg)
    assert slot.waits == [0, 1] and slot.done == [0, 1]
