"""The shim's rooms one by one, without vLLM or a sidecar: batch reading, tensor transfer, step protocol."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from proto.arena import ShmArena
from proto.packed import unpack_u32
from proto.messages import HookNeeds, Overlay, RequestError, StepBegin, StepEnd, StepPlan, StepResult
from proto.plan_trees import encode_tree, whole_mark
from proto.tensors import TensorRef
from tests.test_recovery import FakeConnection, request, step_state
from worker_shim.step.batch import BatchReader, PayloadTracker, new_request
from worker_shim.errors import SidecarError
from worker_shim.upstream.compat import ShimCompatError, client_request_id, request_ids_suffixed
from worker_shim.step.link import SidecarLink
from worker_shim.step.plan_read import read_plan
from worker_shim.step.protocol import before_forward
from worker_shim.step.slots import HiddenSlots


def test_client_request_id_strips_the_suffix_vllm_added():
    assert client_request_id("7-1a2b3c4d", suffixed=True) == "7"
    assert client_request_id("chat-cmpl-42-0a0b0c0d", suffixed=True) == "chat-cmpl-42"
    assert client_request_id("7", suffixed=True) == ""  # the client's id itself: nothing to send
    assert client_request_id("7-1a2b3c4d", suffixed=False) == ""


def test_request_ids_are_suffixed_by_the_vllm_versions_that_do_it():
    assert request_ids_suffixed("0.32.0") and request_ids_suffixed("0.26.1")
    assert not request_ids_suffixed("0.10.2")
    assert not request_ids_suffixed("0.32.0", randomization_disabled=True)
    assert request_ids_suffixed("unknown")  # a dev build: today's behaviour


def test_new_request_carries_the_client_id():
    msg = new_request(request("7-1a2b3c4d", True), {"x": 1}, suffixed_ids=True)
    assert (msg.req_id, msg.client_req_id, msg.prompt_len, msg.payload) == ("7-1a2b3c4d", "7", 3, {"x": 1})


def test_shim_errors_share_one_base():
    assert issubclass(ShimCompatError, SidecarError)


def batch(req_ids: list[str], computed: list[int], prefill: list[int]) -> SimpleNamespace:
    n = len(req_ids)
    return SimpleNamespace(req_ids=req_ids, num_tokens=n, num_computed_tokens_np=np.array(computed),
                           prefill_len_np=np.array(prefill), query_start_loc_np=np.arange(n + 1))


def test_exchange_decision_follows_needs_and_payloads_with_derived_prefill_flags():
    """The step protocol's decision over batches read as a vLLM without its own prefill flags."""
    tracker, reader = PayloadTracker(), BatchReader(own_prefill_flags=False)
    tracker.note_new("a", {"x": 1})
    tracker.note_new("b", None)
    prefill, decode = batch(["a", "b"], [0, 5], [4, 5]), batch(["a", "b"], [4, 6], [4, 5])

    def needed(needs: HookNeeds, step_batch: SimpleNamespace, among: set[str] | None = None) -> bool:
        return before_forward(needs, step_batch.req_ids, lambda: reader.prefilling(step_batch), tracker.payload_reqs,
                              among).send is not None

    payload_prefill = HookNeeds(pre_forward="prefill", pre_forward_scope="payload")
    assert needed(payload_prefill, prefill)
    assert not needed(payload_prefill, decode)
    assert not needed(payload_prefill, prefill, among={"b"})  # "a" unknown to the session
    assert needed(HookNeeds(pre_forward="always", pre_forward_scope="payload"), decode)
    assert needed(HookNeeds(pre_forward="prefill"), prefill)  # scope all
    assert not needed(HookNeeds(), prefill)  # never
    tracker.note_finished({"a"})
    assert not needed(payload_prefill, prefill)


def test_layout_names_requests_only_when_their_order_changed():
    b = batch(["a", "b"], [0, 5], [4, 5])
    first = BatchReader().layout(b, None)
    assert first.req_ids == ["a", "b"] and unpack_u32(first.prefill_lens) == [4, 5]
    assert BatchReader().layout(b, ["a", "b"]).req_ids is None


def test_layout_carries_input_ids_only_when_the_hooks_ask():
    b = batch(["a", "b"], [0, 5], [4, 5])
    b.input_ids = torch.tensor([11, 12, 99])  # b's decode row: the token sampled by the step before
    assert BatchReader().layout(b, None).input_ids is None
    assert unpack_u32(BatchReader().layout(b, None, with_input_ids=True).input_ids) == [11, 12]


def write_hidden(slots: HiddenSlots, step: int, hidden: torch.Tensor, wait_answered, layers=None):
    """`hidden` (then each captured layer's rows) alone in `step`'s slot, as a StepEnd puts them, the
    slot then sent: their refs and the slot's ready event."""
    slot = slots.claim(step, wait_answered)
    ref, layer_refs = slot.put_hidden(hidden, layers)
    event = slot.seal()
    slot.sent()
    return ref, layer_refs, event


def test_hidden_slots_wait_for_the_previous_reader_before_reuse():
    arena = ShmArena.create(4096, prefix="omni-test-hidden")
    try:
        slots = HiddenSlots(arena, 2)
        waited: list[int] = []
        for step in range(3):
            ref, _, event = write_hidden(slots, step, torch.full((2, 4), float(step)), waited.append)
            assert event == -1 and ref.offset == (step % 2) * (4096 // 2)
        assert waited == [0]  # step 2 reuses step 0's slot: only after step 0's result
        with pytest.raises(SidecarError, match="exceed the arena slot"):
            write_hidden(slots, 3, torch.zeros(1024), waited.append)
    finally:
        arena.close()


def test_steady_steps_reuse_their_slot_views_and_the_bytes_still_land_where_the_refs_say(monkeypatch):
    """A steady step puts the same shapes at the same offsets of its slot: the typed views of the
    slot's bytes are made once per slot and shape (then reused), the cache stays bounded, and
    every step's bytes are the step's own."""
    from omni_arena.views import arena_tensor
    from worker_shim.step import slots as slots_module

    made: list[int] = []

    def counting(arena, ref):
        made.append(ref.offset)
        return arena_tensor(arena, ref)

    monkeypatch.setattr(slots_module, "arena_tensor", counting)
    arena = ShmArena.create(1 << 16, prefix="omni-test-hidden")
    try:
        slots = HiddenSlots(arena, 2)
        for step in range(6):
            hidden = torch.full((3, 4), float(step))
            layers = {1: torch.full((3, 4), 100.0 + step), 2: torch.full((3, 4), 200.0 + step)}
            ref, layer_refs, _ = write_hidden(slots, step, hidden, lambda s: None, layers)
            for want, r in ((hidden, ref), (layers[1], layer_refs[1]), (layers[2], layer_refs[2])):
                assert torch.equal(arena_tensor(arena, r), want)
        assert len(made) == 2  # one view per slot (hidden and layer rows stacked), made on the first two steps
        for step in range(6, 6 + slots_module.VIEWS_KEPT):  # prefill-like: a new shape each step
            write_hidden(slots, step, torch.zeros(1, step % 50 + 1), lambda s: None)
        assert len(slots._views) <= slots_module.VIEWS_KEPT
    finally:
        slots = None
        arena.close()
    assert arena._mm.closed  # no cached view kept the mapping


def test_plan_tensors_are_read_out_of_the_sidecar_arena():
    arena = ShmArena.create(4096, prefix="omni-test-plan")
    try:
        rows = torch.frombuffer(arena.raw(0, 32), dtype=torch.float32).view(2, 4)
        rows.copy_(torch.arange(8, dtype=torch.float32).view(2, 4))
        ref = TensorRef(0, 0, 32, [2, 4], "float32")
        plan = StepPlan(step=0, overlays=[Overlay(row_start=1, rows=ref)],
                        extra_kwargs=encode_tree({"k": [whole_mark(0), 3]}), stacks=[ref])
        embeds = torch.zeros(4, 4)
        ib = SimpleNamespace(num_tokens=4, num_tokens_after_padding=4)
        model = torch.nn.Linear(1, 1)
        extra = read_plan(arena, plan, ib, model, embeds)
        assert extra["inputs_embeds"] is embeds  # written in place (CUDA graphs read this buffer)
        assert embeds[0].tolist() == [0.0] * 4 and embeds[2].tolist() == [4.0, 5.0, 6.0, 7.0]
        assert torch.equal(extra["k"][0], rows) and extra["k"][1] == 3
        rows.zero_()
        assert extra["k"][0].sum() > 0  # a copy, not a view of the arena
        too_long = StepPlan(step=0, overlays=[Overlay(row_start=3, rows=ref)])
        with pytest.raises(SidecarError, match="do not fit"):
            read_plan(arena, too_long, ib, model, torch.zeros(4, 4))
        assert read_plan(None, StepPlan(step=0, extra_kwargs=encode_tree({"k": 1})), ib, model, None) == {"k": 1}
    finally:
        arena.close()


class PlanningConnection(FakeConnection):
    """A fake connection that answers StepBegin with an empty plan."""

    def step_plan(self, msg: StepBegin) -> StepPlan:
        self.sent.append(msg)
        if msg.batch.req_ids is not None:
            self.peer_req_ids = msg.batch.req_ids
        return StepPlan(step=msg.step)

    def read_plan(self, plan, input_batch, model, embeds):
        return {}


def test_a_step_asks_before_the_forward_only_when_the_needs_say_so():
    conn = PlanningConnection(needs=HookNeeds(pre_forward="prefill", pre_forward_scope="payload"))
    link = SidecarLink(lambda **kw: None, conn)
    link.note_new([request("plain", False), request("carrier", True)])
    state = step_state(["plain", "carrier"])  # both prefilling
    link.begin_step()
    assert link.in_step
    link.pre_forward(state.input_batch, model=None)
    link.end_step(state)
    assert not link.in_step
    begin, end = conn.sent
    assert isinstance(begin, StepBegin) and [r.req_id for r in begin.new_requests] == ["plain", "carrier"]
    assert isinstance(end, StepEnd) and end.batch is None and end.new_requests == []  # said once
    assert link.counters.blocking_exchanges == 1
    link.note_finished({"carrier"}, None)  # no payload request left: no blocking exchange
    link.begin_step()
    link.pre_forward(step_state(["plain"]).input_batch, model=None)
    link.end_step(step_state(["plain"]))
    assert link.counters.blocking_exchanges == 1 and isinstance(conn.sent[-1], StepEnd)
    assert conn.sent[-1].finished == ["carrier"]


def test_an_aborted_step_sends_nothing():
    conn = FakeConnection()
    link = SidecarLink(lambda **kw: None, conn)
    link.begin_step()
    link.abort_step()
    assert not link.in_step and conn.sent == []


def test_hook_errors_in_results_reach_the_stats():
    conn = FakeConnection()
    link = SidecarLink(lambda **kw: None, conn)
    conn.results = [StepResult(step=0, errors=[RequestError("r", "hook raised")])]
    link.note_new([request("r", False)])
    link.begin_step()
    link.end_step(step_state(["r"]))
    stats = link.stats()
    assert stats["connected"] and stats["steps"] == 1 and stats["new_requests"] == 1
    assert stats["request_errors"] == {"r": "hook raised"}


def test_per_step_timings_stay_bounded_and_keep_the_latest():
    from proto.settings import TIMINGS_KEPT
    from worker_shim.step.link import StepCounters

    record_timing = StepCounters.record_timing

    samples: list[float] = []
    for i in range(5 * TIMINGS_KEPT):
        record_timing(samples, float(i))
        assert len(samples) <= 2 * TIMINGS_KEPT
    assert samples[-1] == 5 * TIMINGS_KEPT - 1 and len(samples) >= TIMINGS_KEPT
    assert samples == [float(i) for i in range(5 * TIMINGS_KEPT - len(samples), 5 * TIMINGS_KEPT)]


def test_model_results_stack_straight_into_the_slot_and_an_unsendable_tree_fails_only_its_request(monkeypatch):
    """A kind's rows are stacked in the slot itself (no stacked copy put after); a request whose tree
    msgpack cannot carry (a 9-dimensional tensor) fails alone, the others' results go."""
    from omni_arena.tensor_tree import TreeDecoder
    from omni_arena.views import arena_tensor
    from worker_shim.session.requests import FailureReports
    from worker_shim.step.step_end import StepEnds

    arena = ShmArena.create(1 << 16, prefix="omni-test-results")
    try:
        slot = HiddenSlots(arena, 2).claim(0, lambda s: None)
        monkeypatch.setattr(slot, "put", lambda *a, **k: pytest.fail("a stack was put as a tensor of its own"))
        failures = FailureReports()
        ends = StepEnds(None, None, failures, None)  # type: ignore[arg-type]  # _encode reads only the failures
        tensors: list[TensorRef] = []
        trees = {"a": {"x": torch.full((3,), 1.0)}, "b": {"x": torch.full((3,), 2.0)}, "bad": {"x": torch.zeros([1] * 9)}}
        data = ends._encode(trees, slot, tensors)
        assert [e.req_id for e in failures.pending] == ["bad"] and "9 dimensions" in failures.pending[0].message
        assert len(tensors) == 1 and tensors[0].shape == [2, 3]  # a's and b's rows: one stack
        decoded = TreeDecoder(len(tensors), lambda k: arena_tensor(arena, tensors[k]), own=True,
                              copy_budget=tensors[0].nbytes).decode(data, dict)
        assert set(decoded) == {"a", "b"} and decoded["b"]["x"].tolist() == [2.0] * 3
    finally:
        arena.close()


def test_vllm_omnis_cpu_platform_is_named_only_for_the_stand_in_on_vllms_cpu_platform(monkeypatch):
    """The shim's `vllm_omni.platform_plugins` entry: a GPU host, or a process that imported vllm-omni for real,
    keeps vllm-omni's own platform (the entry names none)."""
    import sys
    import types
    from pathlib import Path

    from vllm.platforms import current_platform

    from worker_shim.omni_models import cpu_platform
    from worker_shim.omni_models.package import stand_in_module

    monkeypatch.setitem(sys.modules, "vllm_omni", types.ModuleType("vllm_omni"))  # the real package
    assert cpu_platform.cpu_omni_platform() is None
    monkeypatch.setitem(sys.modules, "vllm_omni", stand_in_module(Path(".")))
    monkeypatch.setattr(type(current_platform), "is_cpu", lambda self: False)
    assert cpu_platform.cpu_omni_platform() is None  # a GPU host
    monkeypatch.setattr(type(current_platform), "is_cpu", lambda self: True)
    monkeypatch.setattr(cpu_platform, "VLLM_OMNI_UNSPECIFIED_PLATFORM", ("types", "SimpleNamespace"))
    cpu_platform.platform_class.cache_clear()
    try:
        assert cpu_platform.cpu_omni_platform() == cpu_platform.CPU_OMNI_PLATFORM
        made = cpu_platform.CpuOmniPlatform  # resolved as vllm-omni resolves "module.Class"
        assert made.supports_torch_inductor() is False and made.__module__ == cpu_platform.__name__
        monkeypatch.setattr(cpu_platform, "VLLM_OMNI_UNSPECIFIED_PLATFORM", ("types", "NoSuchPlatform"))
        cpu_platform.platform_class.cache_clear()
        assert cpu_platform.cpu_omni_platform() is None  # vllm-omni without it: said, not a crash
    finally:
        cpu_platform.platform_class.cache_clear()
