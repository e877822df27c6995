"""StepEnd's packed layout (protocol 1.6): what the shim packs is what the sidecar's hooks read, and
anything a correct peer never sends is refused, never half-read."""

from __future__ import annotations

import numpy as np
import pytest

from proto.codec import Codec, FrameError
from proto.layouts import LayoutError, pack_i32, pack_layout, unpack_layout
from proto.messages import MAX_BATCH, BatchLayout, HookNeeds, PackedLayout, StepEnd


def _columns(n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """vLLM's int32 columns for n requests: request i schedules i % 3 + 1 rows."""
    qsl = np.concatenate([[0], np.cumsum([i % 3 + 1 for i in range(n)])]).astype(np.int32)
    return qsl, np.arange(100, 100 + n, dtype=np.int32), np.full(n, 7, dtype=np.int32)


@pytest.mark.parametrize("n", [0, 1, 64, 256])
def test_a_packed_layout_round_trips_through_the_codec_to_the_lists_hooks_read(n):
    qsl, computed, prefill = _columns(n)
    req_ids = [f"r{i}" for i in range(n)]
    input_ids = np.arange(int(qsl[-1]), dtype=np.int64)  # token ids: any integer dtype packs as int32
    codec = Codec()
    msg = codec.decode(codec.encode(StepEnd(step=3, packed=pack_layout(req_ids, qsl, computed, prefill, input_ids))))
    assert unpack_layout(msg.packed) == BatchLayout(req_ids, qsl.tolist(), computed.tolist(), prefill.tolist(),
                                                    input_ids.tolist())
    assert len(msg.packed.num_computed_tokens) == 4 * n  # 4 bytes a row, whatever the values


def test_req_ids_left_out_stay_left_out():
    qsl, computed, prefill = _columns(4)
    assert unpack_layout(pack_layout(None, qsl, computed, prefill)).req_ids is None


def _packed(qsl=(0, 1, 2), computed=(5, 6), prefill=(3, 3), req_ids=None, input_ids=None) -> PackedLayout:
    return PackedLayout(req_ids, pack_i32(qsl), pack_i32(computed), pack_i32(prefill),
                        pack_i32(input_ids) if input_ids is not None else None)


@pytest.mark.parametrize("packed, why", [
    (PackedLayout(None, b"\0" * 9, pack_i32([5, 6]), pack_i32([3, 3])), "whole number"),
    (PackedLayout(None, pack_i32([0, 1, 2]), b"\1\0\0", pack_i32([3, 3])), "whole number"),
    (PackedLayout(None, pack_i32([0, 1, 2]), pack_i32([5, 6]), pack_i32([3, 3]), b"\0" * 5), "whole number"),
    (_packed(qsl=(0, 1)), "disagree"),
    (_packed(prefill=(3,)), "disagree"),
    (_packed(computed=(5, 6, 7), prefill=(3, 3, 3)), "disagree"),
    (_packed(req_ids=["a"]), "names 1 requests"),
    (_packed(computed=(5, -1)), "negative"),
    (_packed(qsl=(0, -4, 2)), "negative"),
    (_packed(prefill=(-3, 3)), "negative"),
    (_packed(qsl=(0, 1, 1 << 30)), "exceeds"),
])
def test_a_malformed_packed_layout_is_refused(packed, why):
    with pytest.raises(LayoutError, match=why):
        unpack_layout(packed)


def test_oversized_packed_columns_are_refused_by_the_decoder_before_any_unpacking():
    codec = Codec()
    huge = PackedLayout(None, b"\0" * 4 * (MAX_BATCH + 2), b"", b"")
    with pytest.raises(FrameError, match="length"):
        codec.decode(codec.encode(StepEnd(step=1, packed=huge)))


def test_a_step_end_with_its_layout_twice_is_refused_by_the_session():
    from omni_sidecar.hooks import OmniHooks
    from omni_sidecar.metrics import SidecarMetrics
    from omni_sidecar.session import Session
    from omni_sidecar.store import FinishedOutputs
    from proto.messages import Hello

    hello = Hello(1, 6, "t", "none", "cpu", 0, 1, "m", 8, "float32", 64, [])
    session = Session(1, hello, OmniHooks(), FinishedOutputs(4), SidecarMetrics())
    both = StepEnd(step=0, num_tokens=2, batch=BatchLayout(["a", "b"], [0, 1, 2], [5, 6], [3, 3]),
                   packed=_packed(req_ids=["a", "b"]))
    with pytest.raises(LayoutError, match="twice"):
        session.step_end(both)


@pytest.mark.parametrize("packs", [True, False])
def test_the_link_packs_the_layout_only_for_a_sidecar_that_reads_it_packed(packs):
    """A sidecar of 1.6 (SidecarConnection.packs_layouts, from its Welcome) gets the packed layout;
    an older one the lists it knows, the same values."""
    from tests.test_recovery import FakeConnection, request, step_state
    from worker_shim.link import SidecarLink

    conn = FakeConnection(needs=HookNeeds(step_layouts=True))
    conn.packs_layouts = packs
    link = SidecarLink(lambda **kw: None, conn)
    link.note_new([request("a", False), request("b", False)])
    state = step_state(["a", "b"])
    link.begin_step()
    link.end_step(state)
    end = conn.sent[-1]
    assert isinstance(end, StepEnd) and (end.packed is not None) == packs and (end.batch is None) == packs
    batch = state.input_batch
    want = BatchLayout(["a", "b"], batch.query_start_loc_np[:3].tolist(), batch.num_computed_tokens_np[:2].tolist(),
                       batch.prefill_len_np[:2].tolist())
    assert (unpack_layout(end.packed) if packs else end.batch) == want
