"""StepEnd's packed layout (protocol 1.6, the same PackedLayout as StepBegin's, proto/packed.py): what
the shim packs is what the sidecar's hooks read, and what a correct peer never sends is refused."""

from __future__ import annotations

import numpy as np
import pytest

from proto.codec import Codec, FrameError
from proto.messages import MAX_BATCH, BatchLayout, HookNeeds, PackedLayout, StepEnd
from proto.packed import LayoutError, LazyLayout, pack_u32, packed_layout


def _columns(n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """vLLM's int32 columns for n requests: request i schedules i % 3 + 1 rows."""
    qsl = np.concatenate([[0], np.cumsum([i % 3 + 1 for i in range(n)])]).astype(np.int32)
    return qsl, np.arange(100, 100 + n, dtype=np.int32), np.full(n, 7, dtype=np.int32)


@pytest.mark.parametrize("n", [0, 1, 64, 256])
def test_a_packed_step_end_round_trips_through_the_codec_to_the_lists_hooks_read(n):
    qsl, computed, prefill = _columns(n)
    req_ids = [f"r{i}" for i in range(n)]
    input_ids = np.arange(int(qsl[-1]), dtype=np.int64)  # token ids: any integer dtype packs as u32
    codec = Codec()
    msg = codec.decode(codec.encode(StepEnd(step=3, packed=packed_layout(req_ids, qsl, computed, prefill, input_ids))))
    assert LazyLayout(req_ids, msg.packed).materialize() == BatchLayout(
        req_ids, qsl.tolist(), computed.tolist(), prefill.tolist(), input_ids.tolist())
    assert len(msg.packed.num_computed_tokens) == 4 * n  # 4 bytes a row, whatever the values


def _packed(qsl=(0, 1, 2), computed=(5, 6), prefill=(3, 3), req_ids=None, input_ids=None) -> PackedLayout:
    return PackedLayout(req_ids, pack_u32(qsl), pack_u32(computed), pack_u32(prefill),
                        pack_u32(input_ids) if input_ids is not None else None)


@pytest.mark.parametrize("packed", [
    PackedLayout(None, b"\0" * 9, pack_u32([5, 6]), pack_u32([3, 3])),
    PackedLayout(None, pack_u32([0, 1, 2]), b"\1\0\0", pack_u32([3, 3])),
    _packed(qsl=(0, 1)),
    _packed(prefill=(3,)),
    _packed(computed=(5, 6, 7), prefill=(3, 3, 3)),
])
def test_a_packed_layout_whose_arrays_do_not_fit_its_requests_is_refused(packed):
    with pytest.raises(LayoutError, match="do not fit"):
        LazyLayout(["a", "b"], packed)


def test_packed_input_ids_of_a_broken_length_are_refused():
    with pytest.raises(LayoutError, match="u32"):
        LazyLayout(["a", "b"], PackedLayout(None, pack_u32([0, 1, 2]), pack_u32([5, 6]), pack_u32([3, 3]), b"\0" * 5))


def test_oversized_packed_columns_are_refused_by_the_decoder_before_any_unpacking():
    codec = Codec()
    huge = PackedLayout(None, b"\0" * 4 * (MAX_BATCH + 2), b"", b"")
    with pytest.raises(FrameError, match="length"):
        codec.decode(codec.encode(StepEnd(step=1, packed=huge)))


def _session():
    from omni_sidecar.hooks import OmniHooks
    from omni_sidecar.metrics import SidecarMetrics
    from omni_sidecar.session import Session
    from omni_sidecar.store import FinishedOutputs
    from proto.messages import Hello

    hello = Hello(1, 6, "t", "none", "cpu", 0, 1, "m", 8, "float32", 64, [])
    return Session(1, hello, OmniHooks(), FinishedOutputs(4), SidecarMetrics())


def test_a_step_end_with_its_layout_twice_is_refused_by_the_session():
    both = StepEnd(step=0, num_tokens=2, batch=BatchLayout(["a", "b"], [0, 1, 2], [5, 6], [3, 3]),
                   packed=_packed(req_ids=["a", "b"]))
    with pytest.raises(ValueError, match="twice"):
        _session().step_end(both)


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
    assert (LazyLayout(end.packed.req_ids, end.packed).materialize() if packs else end.batch) == want
