"""Packed batch layouts (protocol 1.6, StepBegin.packed): packing, checks, and the sidecar reading them."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from omni_sidecar.hooks import OmniHooks
from omni_sidecar.metrics import SidecarMetrics
from omni_sidecar.payload import sidecar_extra_args
from omni_sidecar.session import Session
from omni_sidecar.store import FinishedOutputs
from proto.arena import ShmArena
from proto.codec import Codec
from proto.messages import BatchLayout, ErrorReply, HookNeeds, NewRequest, PackedLayout, StepBegin, StepPlan
from proto.packed import LayoutError, LazyLayout, pack_u32, packed_layout, unpack_u32, unpacked
from tests.support.procs import SidecarProcess
from tests.test_sidecar import Peer, _hello
from worker_shim.batch import packed_batch_layout


H = 8


def test_pack_round_trip_from_lists_and_numpy():
    values = [0, 1, 7, 1 << 20, (1 << 32) - 1]
    assert unpack_u32(pack_u32(values)) == values
    assert unpack_u32(pack_u32(np.array([0, 5, 9], dtype=np.int32))) == [0, 5, 9]
    assert pack_u32(np.array([1, 2], dtype=np.int64)) == pack_u32([1, 2])
    with pytest.raises(OverflowError):
        pack_u32([-1])


def test_lazy_layout_checks_lengths_and_unpacks_on_access():
    packed = packed_layout(["a", "b"], [0, 1, 4], [9, 2], [4, 6], [5, 6, 7, 8])
    lay = LazyLayout(["a", "b"], packed)
    assert lay._qsl is None  # nothing unpacked until read
    assert lay.query_start_loc == [0, 1, 4] and lay.num_computed_tokens == [9, 2] and lay.prefill_lens == [4, 6]
    assert unpacked(lay) == BatchLayout(["a", "b"], [0, 1, 4], [9, 2], [4, 6], [5, 6, 7, 8])
    for bad in (packed_layout(None, [0, 1], [9, 2], [4, 6]),  # qsl too short
                packed_layout(None, [0, 1, 4], [9], [4, 6]),
                packed_layout(None, [0, 1, 4], [9, 2], [4, 6, 1]),
                PackedLayout(None, pack_u32([0, 1, 4]), pack_u32([9, 2]), pack_u32([4, 6]) + b"\0")):
        with pytest.raises(LayoutError):
            LazyLayout(["a", "b"], bad)
    with pytest.raises(LayoutError):
        LazyLayout(["a"], PackedLayout(None, pack_u32([0, 1]), pack_u32([0]), pack_u32([1]), b"\0\0"))


class _Reading(OmniHooks):
    """Reads the whole layout before the forward, as an overlay hook with work to do would."""

    needs = HookNeeds(pre_forward="always")

    def __init__(self) -> None:
        self.seen: list[tuple] = []

    def build_extra_kwargs(self, batch):
        lay = batch.layout
        self.seen.append((list(batch.req_ids), list(lay.query_start_loc), list(lay.num_computed_tokens),
                          list(lay.prefill_lens), [batch.prefill_rows(i) for i in range(len(batch.req_ids))]))
        return {}


def _session(hooks) -> Session:
    hello = _hello([])
    return Session(1, hello, hooks, FinishedOutputs(10), SidecarMetrics())


def test_session_reads_packed_layouts_as_it_reads_lists():
    lists, packed = _Reading(), _Reading()
    s_lists, s_packed = _session(lists), _session(packed)
    steps = [(["a", "b"], [0, 3, 4], [0, 7], [3, 8]), (None, [0, 1, 2], [3, 8], [3, 8]),
             (["b"], [0, 1], [9], [8])]
    for step, (ids, qsl, computed, prefill) in enumerate(steps):
        s_lists.step_begin(StepBegin(step, BatchLayout(ids, qsl, computed, prefill)))
        plan = s_packed.step_begin(StepBegin(step, packed=packed_layout(ids, qsl, computed, prefill)))
        assert plan.errors == []
    assert packed.seen == lists.seen and packed.seen[1][0] == ["a", "b"]  # ids omitted: the previous ones


def test_session_refuses_malformed_packed_steps():
    s = _session(_Reading())
    with pytest.raises(ValueError, match="omits req_ids"):
        s.step_begin(StepBegin(0, packed=packed_layout(None, [0, 1], [0], [1])))
    with pytest.raises(ValueError, match="do not fit"):
        s.step_begin(StepBegin(0, packed=packed_layout(["a"], [0, 1], [0, 0], [1])))
    with pytest.raises(ValueError, match="both"):
        s.step_begin(StepBegin(0, BatchLayout(["a"], [0, 1], [0], [1]), packed=packed_layout(["a"], [0, 1], [0], [1])))
    with pytest.raises(ValueError, match="no batch layout"):
        s.step_begin(StepBegin(0))


class _FakeInputBatch:
    """What `packed_batch_layout` reads of vLLM's InputBatch (numpy arrays longer than the batch)."""

    def __init__(self) -> None:
        self.req_ids = ["x", "y"]
        self.query_start_loc_np = np.array([0, 2, 3, 0, 0], dtype=np.int32)
        self.num_computed_tokens_np = np.array([4, 0, 0], dtype=np.int32)
        self.prefill_len_np = np.array([6, 3, 0], dtype=np.int32)
        self.input_ids = torch.tensor([11, 12, 13, 0], dtype=torch.int32)
        self.num_tokens = 3


def test_shim_packs_vllms_arrays():
    batch = _FakeInputBatch()
    packed = packed_batch_layout(batch, None, with_input_ids=True)
    assert unpacked(LazyLayout(packed.req_ids, packed)) == BatchLayout(["x", "y"], [0, 2, 3], [4, 0], [6, 3],
                                                                       [11, 12, 13])
    assert packed_batch_layout(batch, ["x", "y"]).req_ids is None and packed.input_ids is not None


@pytest.fixture
def overlay_sidecar(tmp_path):
    proc = SidecarProcess(f"ipc://{tmp_path}/p.sock", "overlay", tmp_path / "sidecar.log")
    yield proc
    proc.stop()


def test_packed_overlay_plan_and_bad_packed_frames_over_the_wire(overlay_sidecar):
    peer = Peer(overlay_sidecar.endpoint)
    welcome = peer.call(_hello([]))
    assert welcome.protocol_minor >= 6
    out = ShmArena.attach(welcome.arenas[0])
    embeds = torch.randn(6, H)
    payload = sidecar_extra_args(prompt_embeds=embeds)["omni_sidecar"]
    # As test_sidecar's overlay plan, packed: rows [1, 4) take embeds[2:5].
    layout = packed_layout(["d", "p"], [0, 1, 4], [9, 2], [4, 6])
    plan = peer.call(StepBegin(0, new_requests=[NewRequest("p", 6, [3] * 6, payload)], packed=layout))
    assert isinstance(plan, StepPlan) and plan.errors == [] and plan.overlays[0].row_start == 1
    rows = torch.from_numpy(np.frombuffer(bytes(out.view(plan.overlays[0].rows)), dtype=np.float32).reshape(3, H).copy())
    torch.testing.assert_close(rows, embeds[2:5])
    # Arrays that do not fit the request count, or are not u32 entries: an ErrorReply, the sidecar serves on.
    codec = Codec()
    for bad in (packed_layout(None, [0, 1, 2, 3], [9, 2], [4, 6]),
                PackedLayout(None, pack_u32([0, 1, 4]) + b"\1", pack_u32([9, 2]), pack_u32([4, 6]))):
        reply = peer.call(None, raw=codec.encode(StepBegin(1, packed=bad)))
        assert isinstance(reply, ErrorReply)
    plan = peer.call(StepBegin(2, packed=packed_layout(None, [0, 1, 2], [10, 5], [4, 6])))
    assert isinstance(plan, StepPlan) and plan.step == 2 and plan.overlays[0].row_start == 1
    out.close()
    peer.close()
