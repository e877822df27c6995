"""Batch layouts (StepBegin.batch, StepEnd.batch: per-request ints as packed u32 arrays): packing,
checks, and the sidecar reading them."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from omni_sidecar.hook_api.hook_set import OmniHooks
from omni_sidecar.serve.metrics import SidecarMetrics
from omni_sidecar.payload import sidecar_extra_args
from omni_sidecar.sessions.session import Session
from omni_sidecar.sessions.store import FinishedOutputs
from proto.arena import ShmArena
from proto.codec import Codec, FrameError
from proto.messages import MAX_BATCH, BatchLayout, ErrorReply, HookNeeds, NewRequest, StepBegin, StepEnd, StepPlan
from proto.packed import LayoutError, StepLayout, pack_u32, packed_layout, unpack_u32
from tests.support.procs import SidecarProcess
from tests.test_sidecar import Peer, _hello
from worker_shim.step.batch import BatchReader


H = 8


def test_pack_round_trip_from_lists_and_numpy():
    values = [0, 1, 7, 1 << 20, (1 << 32) - 1]
    assert unpack_u32(pack_u32(values)) == values
    assert unpack_u32(pack_u32(np.array([0, 5, 9], dtype=np.int32))) == [0, 5, 9]
    assert pack_u32(np.array([1, 2], dtype=np.int64)) == pack_u32([1, 2])
    with pytest.raises(OverflowError):
        pack_u32([-1])


def test_step_layout_checks_lengths_and_unpacks_on_access():
    packed = packed_layout(["a", "b"], [0, 1, 4], [9, 2], [4, 6], [5, 6, 7, 8])
    lay = StepLayout.unpacking(["a", "b"], packed)
    assert not {"query_start_loc", "num_computed_tokens", "prefill_lens", "input_ids"} & vars(lay).keys()  # nothing unpacked until read
    assert lay.query_start_loc == [0, 1, 4] and lay.num_computed_tokens == [9, 2] and lay.prefill_lens == [4, 6]
    assert lay == StepLayout(["a", "b"], [0, 1, 4], [9, 2], [4, 6], [5, 6, 7, 8])
    assert lay.packed() == packed and lay != StepLayout(["a", "b"], [0, 1, 4], [9, 2], [4, 6])
    for bad in (packed_layout(None, [0, 1], [9, 2], [4, 6]),  # qsl too short
                packed_layout(None, [0, 1, 4], [9], [4, 6]),
                packed_layout(None, [0, 1, 4], [9, 2], [4, 6, 1]),
                BatchLayout(None, pack_u32([0, 1, 4]), pack_u32([9, 2]), pack_u32([4, 6]) + b"\0")):
        with pytest.raises(LayoutError):
            StepLayout.unpacking(["a", "b"], bad)
    with pytest.raises(LayoutError):
        StepLayout.unpacking(["a"], BatchLayout(None, pack_u32([0, 1]), pack_u32([0]), pack_u32([1]), b"\0\0"))


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


def test_session_reads_packed_layouts_as_lists():
    hooks = _Reading()
    session = _session(hooks)
    steps = [(["a", "b"], [0, 3, 4], [0, 7], [3, 8]), (None, [0, 1, 2], [3, 8], [3, 8]),
             (["b"], [0, 1], [9], [8])]
    for step, (ids, qsl, computed, prefill) in enumerate(steps):
        plan = session.step_begin(StepBegin(step, packed_layout(ids, qsl, computed, prefill)))
        assert plan.errors == []
    assert hooks.seen == [  # ids omitted: the previous ones
        (["a", "b"], [0, 3, 4], [0, 7], [3, 8], [(0, 3, 0), (3, 1, 7)]),
        (["a", "b"], [0, 1, 2], [3, 8], [3, 8], [(0, 0, 3), (1, 0, 8)]),
        (["b"], [0, 1], [9], [8], [(0, 0, 9)]),
    ]


def test_session_refuses_malformed_packed_steps():
    s = _session(_Reading())
    with pytest.raises(ValueError, match="omits req_ids"):
        s.step_begin(StepBegin(0, packed_layout(None, [0, 1], [0], [1])))
    with pytest.raises(ValueError, match="do not fit"):
        s.step_begin(StepBegin(0, packed_layout(["a"], [0, 1], [0, 0], [1])))


class _FakeInputBatch:
    """What `BatchReader.layout` reads of vLLM's InputBatch (numpy arrays longer than the batch)."""

    def __init__(self) -> None:
        self.req_ids = ["x", "y"]
        self.query_start_loc_np = np.array([0, 2, 3, 0, 0], dtype=np.int32)
        self.num_computed_tokens_np = np.array([4, 0, 0], dtype=np.int32)
        self.prefill_len_np = np.array([6, 3, 0], dtype=np.int32)
        self.input_ids = torch.tensor([11, 12, 13, 0], dtype=torch.int32)
        self.num_tokens = 3


def test_shim_packs_vllms_arrays():
    batch = _FakeInputBatch()
    packed = BatchReader().layout(batch, None, with_input_ids=True)
    assert StepLayout.unpacking(packed.req_ids, packed) == StepLayout(["x", "y"], [0, 2, 3], [4, 0], [6, 3],
                                                                      [11, 12, 13])
    assert BatchReader().layout(batch, ["x", "y"]).req_ids is None and packed.input_ids is not None


@pytest.fixture
def overlay_sidecar(tmp_path):
    proc = SidecarProcess(f"ipc://{tmp_path}/p.sock", "overlay", tmp_path / "sidecar.log")
    yield proc
    proc.stop()


def test_packed_overlay_plan_and_bad_packed_frames_over_the_wire(overlay_sidecar):
    peer = Peer(overlay_sidecar.endpoint)
    welcome = peer.call(_hello([]))
    out = ShmArena.attach(welcome.arenas[0])
    embeds = torch.randn(6, H)
    payload = sidecar_extra_args(prompt_embeds=embeds)["omni_sidecar"]
    # As test_sidecar's overlay plan, packed: rows [1, 4) take embeds[2:5].
    layout = packed_layout(["d", "p"], [0, 1, 4], [9, 2], [4, 6])
    plan = peer.call(StepBegin(0, layout, new_requests=[NewRequest("p", 6, [3] * 6, payload)]))
    assert isinstance(plan, StepPlan) and plan.errors == [] and plan.overlays[0].row_start == 1
    rows = torch.from_numpy(np.frombuffer(bytes(out.view(plan.overlays[0].rows)), dtype=np.float32).reshape(3, H).copy())
    torch.testing.assert_close(rows, embeds[2:5])
    # Arrays that do not fit the request count, or are not u32 entries: an ErrorReply, the sidecar serves on.
    codec = Codec()
    for bad in (packed_layout(None, [0, 1, 2, 3], [9, 2], [4, 6]),
                BatchLayout(None, pack_u32([0, 1, 4]) + b"\1", pack_u32([9, 2]), pack_u32([4, 6]))):
        reply = peer.call(None, raw=codec.encode(StepBegin(1, bad)))
        assert isinstance(reply, ErrorReply)
    plan = peer.call(StepBegin(2, packed_layout(None, [0, 1, 2], [10, 5], [4, 6])))
    assert isinstance(plan, StepPlan) and plan.step == 2 and plan.overlays[0].row_start == 1
    out.close()
    peer.close()


# -- StepEnd.batch ---------------------------------------------------------------------------


def _columns(n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """vLLM's int32 columns for n requests: request i schedules i % 3 + 1 rows."""
    qsl = np.concatenate([[0], np.cumsum([i % 3 + 1 for i in range(n)])]).astype(np.int32)
    return qsl, np.arange(100, 100 + n, dtype=np.int32), np.full(n, 7, dtype=np.int32)


@pytest.mark.parametrize("n", [0, 1, 64, 256])
def test_a_step_end_layout_round_trips_through_the_codec_to_the_lists_hooks_read(n):
    qsl, computed, prefill = _columns(n)
    req_ids = [f"r{i}" for i in range(n)]
    input_ids = np.arange(int(qsl[-1]), dtype=np.int64)  # token ids: any integer dtype packs as u32
    codec = Codec()
    msg = codec.decode(codec.encode(StepEnd(step=3, batch=packed_layout(req_ids, qsl, computed, prefill, input_ids))))
    assert StepLayout.unpacking(req_ids, msg.batch) == StepLayout(
        req_ids, qsl.tolist(), computed.tolist(), prefill.tolist(), input_ids.tolist())
    assert len(msg.batch.num_computed_tokens) == 4 * n  # 4 bytes a row, whatever the values


def _step_end_packed(qsl=(0, 1, 2), computed=(5, 6), prefill=(3, 3), req_ids=None, input_ids=None) -> BatchLayout:
    return BatchLayout(req_ids, pack_u32(qsl), pack_u32(computed), pack_u32(prefill),
                        pack_u32(input_ids) if input_ids is not None else None)


@pytest.mark.parametrize("packed", [
    BatchLayout(None, b"\0" * 9, pack_u32([5, 6]), pack_u32([3, 3])),
    BatchLayout(None, pack_u32([0, 1, 2]), b"\1\0\0", pack_u32([3, 3])),
    _step_end_packed(qsl=(0, 1)),
    _step_end_packed(prefill=(3,)),
    _step_end_packed(computed=(5, 6, 7), prefill=(3, 3, 3)),
])
def test_a_packed_layout_whose_arrays_do_not_fit_its_requests_is_refused(packed):
    with pytest.raises(LayoutError, match="do not fit"):
        StepLayout.unpacking(["a", "b"], packed)


def test_packed_input_ids_of_a_broken_length_are_refused():
    with pytest.raises(LayoutError, match="u32"):
        StepLayout.unpacking(["a", "b"], BatchLayout(None, pack_u32([0, 1, 2]), pack_u32([5, 6]), pack_u32([3, 3]),
                                                     b"\0" * 5))


def test_oversized_packed_columns_are_refused_by_the_decoder_before_any_unpacking():
    codec = Codec()
    huge = BatchLayout(None, b"\0" * 4 * (MAX_BATCH + 2), b"", b"")
    with pytest.raises(FrameError, match="length"):
        codec.decode(codec.encode(StepEnd(step=1, batch=huge)))


def test_the_link_sends_the_layout_packed():
    """The shim's StepEnd carries the batch's columns as packed arrays: the values vLLM holds."""
    from tests.test_recovery import FakeConnection, request, step_state
    from worker_shim.step.link import SidecarLink

    conn = FakeConnection(needs=HookNeeds(step_layouts=True))
    link = SidecarLink(lambda **kw: None, conn)
    link.note_new([request("a", False), request("b", False)])
    state = step_state(["a", "b"])
    link.begin_step()
    link.end_step(state)
    end = conn.sent[-1]
    assert isinstance(end, StepEnd) and end.batch is not None
    batch = state.input_batch
    want = StepLayout(["a", "b"], batch.query_start_loc_np[:3].tolist(), batch.num_computed_tokens_np[:2].tolist(),
                      batch.prefill_len_np[:2].tolist())
    assert StepLayout.unpacking(end.batch.req_ids, end.batch) == want
