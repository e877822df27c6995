"""The model-hook bridge without vLLM: a fake talker's hooks called in vllm-omni's order,
the shim's state mirror, StepEnd model results through a real arena, and the sidecar side
(states sent once, updates merged, codes assembled) in a real Session."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, NamedTuple

import numpy as np
import pytest
import torch

import msgspec

from omni_arena.tensor_tree import TreeDecoder, TreeEncoder
from omni_arena.views import arena_tensor
from omni_sidecar.serve.metrics import SidecarMetrics
from omni_sidecar.hook_sets.omni.stages import TalkerHooks
from omni_sidecar.sessions.session import Session
from omni_sidecar.sessions.store import FinishedOutputs
from proto.arena import ShmArena
from proto.messages import Hello, HookNeeds, NewRequest, StepBegin, StepEnd, StepPlan
from proto.packed import StepLayout, packed_layout
from proto.plan_trees import decode_tree, encode_tree, whole_mark
from proto.tensors import TensorRef
from proto.version import PROTOCOL_MAJOR
from tests.test_recovery import FakeConnection, request
from worker_shim.step.link import SidecarLink
from worker_shim.model.bridge import ModelBridge, find_model_hooks, per_request, unwrap_forward_output
from worker_shim.model.state_mirror import StateMirror
from worker_shim.step.slots import HiddenSlots

H, Q = 4, 3


class NamedTupleOmniOutput(NamedTuple):  # vllm-omni's OmniOutput is a NamedTuple of this shape
    text_hidden_states: torch.Tensor
    multimodal_outputs: Any = None


class FakeTalker(torch.nn.Module):
    """vllm-omni's hook API on a toy: prefill rows from the state, decode rows through talker_mtp."""

    has_preprocess = True
    has_postprocess = True
    have_multimodal_outputs = True
    talker_mtp_output_key = ("codes", "audio")
    gpu_resident_buffer_keys = {("hidden_states", "last")}

    def __init__(self, batched: bool = False) -> None:
        super().__init__()
        self.scale = torch.nn.Parameter(torch.ones(()))
        self.calls: list[tuple] = []
        if batched:
            self.preprocess_decode_batch = self._decode_batch

    def preprocess(self, input_ids, input_embeds, **info):
        self.calls.append(("pre", info["request_id"], int(input_ids.shape[0])))
        if info["_omni_is_prefill"]:
            nc = info["_omni_num_computed_tokens"]
            rows = info["embed"]["prefill"][nc : nc + input_ids.shape[0]]
            return input_ids, rows, {"meta": {"prefilled": nc + rows.shape[0]}}
        last, text, update = self._decode_inputs(info)
        return input_ids, input_embeds, {"mtp_inputs": (last, text), **update}

    def _decode_inputs(self, info):
        pos = int(info.get("meta", {}).get("text_pos", 0))
        return info["hidden_states"]["last"].reshape(1, -1), info["text"]["rows"][pos : pos + 1], \
            {"meta": {"text_pos": pos + 1}}

    def _decode_batch(self, *, input_ids, req_infos):
        self.calls.append(("pre_batch", [i["request_id"] for i in req_infos]))
        parts = [self._decode_inputs(info) for info in req_infos]
        embeds = torch.zeros(len(req_infos), H)
        return (input_ids, embeds, torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts]),
                [p[2] for p in parts])

    def talker_mtp(self, input_ids, input_embeds, last_talker_hidden, text_step, **sampling):
        self.calls.append(("mtp", input_ids.tolist(), *([sampling] if sampling else [])))
        codes = torch.stack([input_ids, input_ids + 1, input_ids + 2], dim=1).long()
        return input_embeds + text_step + last_talker_hidden, codes

    def postprocess(self, hidden_states, multimodal_outputs=None, **info):
        self.calls.append(("post", info["request_id"], int(hidden_states.shape[0])))
        return {"hidden_states": {"last": hidden_states[-1:]}}

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None):
        hidden = inputs_embeds * 2
        return hidden, hidden.sum(-1)  # a tuple: V2 gets the tensor, the sum is a per-token output


def step_batch(req_ids, rows, computed, ids):
    qsl = np.concatenate([[0], np.cumsum(rows)])
    return SimpleNamespace(req_ids=req_ids, num_tokens=int(qsl[-1]), num_tokens_after_padding=int(qsl[-1]),
                           query_start_loc_np=qsl, num_computed_tokens_np=np.array(computed),
                           prefill_len_np=np.array([5] * len(req_ids)), input_ids=torch.tensor(ids))


def states():
    prompt = torch.arange(20, dtype=torch.float32).view(5, H)
    text = torch.full((3, H), 0.5)
    return {"a": {"embed": {"prefill": prompt}, "text": {"rows": text}},
            "b": {"embed": {"prefill": prompt}, "text": {"rows": text},
                  "hidden_states": {"last": torch.ones(1, H)}}}


def test_plain_models_have_no_hooks_and_talkers_show_theirs():
    assert find_model_hooks(torch.nn.Linear(2, 2)) is None
    wire = find_model_hooks(FakeTalker(batched=True)).wire()
    assert wire.has_preprocess and wire.has_postprocess and wire.batch_decode_preprocess
    assert wire.mtp_output_key == "codes.audio" and wire.resident_keys == ["hidden_states.last"]


def test_forward_results_are_unwrapped_for_upstream_v2():
    h = torch.ones(3, H)
    assert unwrap_forward_output(h) == (h, None)
    hidden, extras = unwrap_forward_output((h, h.sum(-1)))
    assert hidden is h and torch.equal(extras["model_output"]["1"], h.sum(-1))
    omni = SimpleNamespace(text_hidden_states=h, multimodal_outputs={"codes": {"audio": torch.zeros(3, Q)}})
    hidden, extras = unwrap_forward_output(omni)
    assert hidden is h and set(extras) == {"codes"}
    cut = per_request(extras, 1, 1, 3, num_reqs=2, num_tokens=3)
    assert cut["codes"]["audio"].shape == (2, Q)
    # vllm-omni's OmniOutput is a NamedTuple: its multimodal outputs are not tuple extras.
    wave = torch.ones(5)
    as_tuple = NamedTupleOmniOutput(h, {"model_outputs": [wave, None]})
    hidden, extras = unwrap_forward_output(as_tuple)
    assert hidden is h and set(extras) == {"model_outputs"}
    assert per_request(extras, 0, 0, 2, num_reqs=2, num_tokens=3)["model_outputs"] is wave
    assert per_request(extras, 1, 2, 3, num_reqs=2, num_tokens=3) == {}


def test_one_step_calls_the_hooks_in_vllm_omnis_order():
    model = FakeTalker()
    bridge = ModelBridge(model, find_model_hooks(model))
    for req_id in "ab":
        bridge.note_new(req_id, 5)
    bridge.fill_states(states(), failed=set())
    # a prefills rows 0..2 of its prompt; b decodes (code-0 id 7 sampled by the step before).
    batch = step_batch(["a", "b"], [3, 1], [0, 5], [3, 3, 3, 7])
    embeds = torch.zeros(4, H)
    bridge.before_forward(batch, embeds)
    assert model.calls == [("pre", "a", 3), ("pre", "b", 1), ("mtp", [7])]
    assert torch.equal(embeds[:3], states()["a"]["embed"]["prefill"][:3])
    assert torch.equal(embeds[3], torch.full((H,), 1.5))  # talker_mtp's embeddings replaced the row
    hidden = model(batch.input_ids, None, inputs_embeds=embeds)  # the wrapped forward: a tensor
    assert isinstance(hidden, torch.Tensor)
    assert bridge.after_forward(batch, hidden) == {}
    assert model.calls[3:] == [("post", "a", 3), ("post", "b", 1)]
    updates, outputs = bridge.take_step()
    assert updates["a"]["meta"] == {"prefilled": 3} and torch.equal(updates["a"]["hidden_states"]["last"], hidden[2:3])
    assert updates["b"]["meta"] == {"text_pos": 1} and updates["b"]["codes"]["audio"].tolist() == [[7, 8, 9]]
    assert outputs["b"]["codes"]["audio"] is updates["b"]["codes"]["audio"]  # one tensor, sent once
    assert torch.equal(outputs["a"]["model_output"]["1"], hidden[:3].sum(-1))
    assert "mtp_inputs" not in bridge.mirror.states["b"]  # popped, never state
    assert bridge.take_step() == ({}, {})


def test_talker_mtp_gets_the_shims_subtalker_sampling_setting():
    """As vllm-omni's runner passes `subtalker_sampling_params` (greedy codes need do_sample=False)."""
    from worker_shim.config import ShimConfig

    extra = {"omni_sidecar": {"endpoint": "ipc:///tmp/x.sock", "subtalker_sampling": {"do_sample": False}}}
    setting = ShimConfig.from_vllm(SimpleNamespace(additional_config=extra)).subtalker_sampling
    with pytest.raises(ValueError, match="subtalker_sampling"):
        ShimConfig.from_vllm(SimpleNamespace(additional_config={"omni_sidecar": {
            "endpoint": "ipc:///tmp/x.sock", "subtalker_sampling": {"seed": 1}}}))
    model = FakeTalker()
    bridge = ModelBridge(model, find_model_hooks(model), setting)
    bridge.note_new("b", 5)
    bridge.fill_states({"b": states()["b"]}, failed=set())
    bridge.before_forward(step_batch(["b"], [1], [5], [7]), torch.zeros(1, H))
    assert model.calls[-1] == ("mtp", [7], {"do_sample": False})


def test_decode_rows_batch_through_preprocess_decode_batch_flushed_before_other_rows():
    model = FakeTalker(batched=True)
    bridge = ModelBridge(model, find_model_hooks(model))
    two = states()
    two["c"] = two["b"]
    for req_id in "abc":
        bridge.note_new(req_id, 5)
    bridge.fill_states(two, failed=set())
    batch = step_batch(["b", "a", "c"], [1, 2, 1], [5, 0, 6], [7, 3, 3, 9])
    bridge.before_forward(batch, torch.zeros(4, H))
    assert model.calls == [("pre_batch", ["b"]), ("pre", "a", 2), ("pre_batch", ["c"]), ("mtp", [7, 9])]
    assert bridge.mirror.states["c"]["codes"]["audio"].tolist() == [[9, 10, 11]]


def test_ids_a_preprocess_wrote_are_never_looked_up_as_a_later_steps_padding():
    """vllm-omni's Qwen3-Omni talker returns the thinker's ids for its prompt rows; the bridge writes
    them into vLLM's input_ids for the forward, as vllm-omni does. vLLM rewrites only the rows of a
    step's tokens, and a step padded for a CUDA graph has its padding rows looked up with the rest in
    the embeds buffer: there, the thinker's ids were past the talker's table (on the H200 a
    device-side assert at the first padded prefill after a larger one)."""
    from worker_shim.model.embeds import EmbedsBuffer
    from worker_shim.upstream.runner import SidecarRunnerMixin, swap_class

    class ThinkerIdsTalker(FakeTalker):
        def __init__(self) -> None:
            super().__init__()
            self.table = torch.nn.Embedding(16, H)  # the talker's own ids: 0..15

        def preprocess(self, input_ids, input_embeds, **info):
            ids, embeds, update = super().preprocess(input_ids, input_embeds, **info)
            return (ids + 1000 if info["_omni_is_prefill"] else ids), embeds, update

        def embed_input_ids(self, input_ids):
            return self.table(input_ids)

    class UpstreamRunner:
        def prepare_inputs(self, input_batch):
            return input_batch

    model = ThinkerIdsTalker()
    bridge = ModelBridge(model, find_model_hooks(model))
    runner = UpstreamRunner()
    swap_class(runner, SidecarRunnerMixin)
    runner.omni_link, runner.omni_bridge = SimpleNamespace(in_step=False), bridge
    buffer = EmbedsBuffer(8, H, torch.float32, torch.device("cpu"))
    input_ids = torch.zeros(8, dtype=torch.long)  # vLLM's persistent buffer

    def step(req_ids, rows, computed, ids, padded):
        input_ids[: len(ids)] = torch.tensor(ids)  # vLLM writes the step's tokens only
        batch = step_batch(req_ids, rows, computed, ids)
        batch.num_tokens_after_padding, batch.input_ids = padded, input_ids[:padded]
        batch = runner.prepare_inputs(batch)
        bridge.before_forward(batch, buffer.fill(model, batch.input_ids, padded))

    for req_id in "ab":
        bridge.note_new(req_id, 5)
    bridge.fill_states(states(), failed=set())
    step(["a"], [5], [0], [3, 3, 3, 3, 3], padded=5)  # a's prefill
    assert input_ids.tolist() == [1003] * 5 + [0] * 3  # the forward's ids are the preprocess's
    step(["b"], [1], [5], [7], padded=2)  # b decodes, one padding row
    assert input_ids.tolist() == [7, 0] + [1003] * 3 + [0] * 3  # rows past the padding: not read
    step(["b"], [1], [6], [8], padded=8)
    assert input_ids.tolist() == [8] + [0] * 7
    assert model.calls[-1] == ("mtp", [8])


def test_kept_rows_are_the_mirrors_own_when_the_next_step_overwrites_the_models_buffers():
    """postprocess keeps views of its hidden rows and talker_mtp may return a graph's output buffer:
    both are overwritten by the next step, the mirror's states and the step's updates are not."""
    model = FakeTalker(batched=True)
    out_codes = torch.zeros(2, 3, dtype=torch.long)  # one buffer, rewritten by every call

    def talker_mtp(input_ids, input_embeds, last_talker_hidden, text_step, **_):
        out_codes.copy_(torch.stack([input_ids, input_ids + 1, input_ids + 2], dim=1))
        return input_embeds, out_codes[: input_ids.shape[0]]

    model.talker_mtp = talker_mtp
    model.gpu_resident_buffer_keys = {("hidden_states", "last"), ("codes", "audio")}
    bridge = ModelBridge(model, find_model_hooks(model))
    two = states()
    two["c"] = two["b"]
    for req_id in "bc":
        bridge.note_new(req_id, 5)
    bridge.fill_states({k: two[k] for k in "bc"}, failed=set())
    batch = step_batch(["b", "c"], [1, 1], [5, 5], [7, 9])
    bridge.before_forward(batch, torch.zeros(2, H))
    hidden = torch.arange(2 * H, dtype=torch.float32).view(2, H)
    bridge.after_forward(batch, hidden)
    updates, outputs = bridge.take_step()
    hidden.zero_()
    out_codes.zero_()
    for i, req_id in enumerate("bc"):
        state = bridge.mirror.states[req_id]
        assert torch.equal(state["hidden_states"]["last"], torch.arange(i * H, (i + 1) * H, dtype=torch.float32).view(1, H))
        assert state["codes"]["audio"].tolist() == [[7 + 2 * i, 8 + 2 * i, 9 + 2 * i]]
        assert updates[req_id]["hidden_states"]["last"] is state["hidden_states"]["last"]
        assert outputs[req_id]["codes"]["audio"] is state["codes"]["audio"]


def test_mirror_keeps_resident_keys_copies_the_rest_and_frees_at_finish():
    mirror = StateMirror(frozenset({("hidden_states", "last")}))
    mirror.fill("r", {"meta": {"n": 1}})
    last, other = torch.ones(2), torch.ones(2)
    mirror.merge("r", {"hidden_states": {"last": last, "other": other}, "meta": {"m": 2}})
    other.zero_()
    assert mirror.states["r"]["meta"] == {"n": 1, "m": 2}  # two-level merge
    assert mirror.states["r"]["hidden_states"]["other"].sum() == 2  # a copy, not the model's tensor
    mirror.merge("gone", {"meta": {"x": 1}})  # unknown request: no-op
    assert mirror.missing(["r", "s"]) == ["s"]
    mirror.free(["r"])
    assert "r" not in mirror and mirror.take_step() == ({}, {})


class StatesConnection(FakeConnection):
    """Answers StepBegin with the states asked for; keeps a real slot arena for StepEnd."""

    def __init__(self, arena) -> None:
        super().__init__(needs=HookNeeds(model_states=True))
        self.slots = HiddenSlots(arena, 2)

    def step_plan(self, msg: StepBegin) -> StepPlan:
        self.sent.append(msg)
        return StepPlan(step=msg.step, model_states=encode_tree({r: {"asked": True} for r in msg.want_states}))

    def read_states(self, plan):
        return decode_tree(plan.model_states)

    def read_plan(self, plan, input_batch, model, embeds):
        return {}

    def claim_slot(self, step, wait):
        return self.slots.claim(step, wait)


def test_the_link_asks_for_states_once_and_sends_results_through_the_slot():
    arena = ShmArena.create(1 << 16, prefix="omni-test-model-io")
    try:
        conn = StatesConnection(arena)
        link = SidecarLink(lambda **kw: None, conn)
        model = FakeTalker()
        bridge = ModelBridge(model, find_model_hooks(model))
        link.note_new([request("a", True)])
        bridge.note_new("a", 3)
        for step in range(3):  # a new request, then two steps with nothing new
            batch = step_batch(["a"], [1], [3 + step], [5])
            link.begin_step()
            link.pre_forward(batch, model, torch.zeros(1, H), bridge)
            bridge.mirror.merge("a", {"codes": {"audio": torch.tensor([[step, 1, 2]])}})
            link.end_step(SimpleNamespace(input_batch=batch, hidden_states=None), bridge.take_step())
        begins = [m for m in conn.sent if isinstance(m, StepBegin)]
        assert len(begins) == 1 and begins[0].want_states == ["a"] and begins[0].model_hooks.has_postprocess
        assert bridge.mirror.states["a"]["asked"] is True
        assert link.counters.blocking_exchanges == 1 and link.counters.steps == 3
        last = conn.sent[-1]
        assert isinstance(last, StepEnd) and last.hidden_event == -1
        got = _read_tree(arena, last.model_updates, last.tensors)
        assert got["a"]["codes"]["audio"].tolist() == [[2, 1, 2]]
    finally:
        arena.close()


def _read_tree(arena: ShmArena, data: bytes, tensors: list[TensorRef]) -> Any:
    """A tree as the receiving side reads it, its tensors out of `arena`."""
    return TreeDecoder(len(tensors), lambda k: arena_tensor(arena, tensors[k]).clone()).decode(data, dict[str, Any])


def _slot_trees(slot, *trees: dict) -> tuple[list[bytes], list[TensorRef]]:
    """Trees as a shim's StepEnd carries them: their tensors in `slot`, the marks naming them."""
    tensors: list[TensorRef] = []

    def put(tensor: torch.Tensor) -> int:
        tensors.append(slot.put(tensor))
        return len(tensors) - 1

    encoder = TreeEncoder()
    return [encoder.encode(tree, put, lambda rows: put(torch.stack(rows)), len(tensors)) for tree in trees], tensors


def _session(hooks) -> tuple[Session, ShmArena]:
    shim_arena = ShmArena.create(1 << 16, prefix="omni-test-shim-slot")
    hello = Hello(PROTOCOL_MAJOR, 0, "test", "none", "cpu", 0, 1, "m", H, "float32", 8, [shim_arena.info()])
    session = Session(1, hello, hooks, FinishedOutputs(10), SidecarMetrics())
    session.open_arenas()
    return session, shim_arena


def test_the_sidecar_sends_states_with_int_keys_merges_updates_and_assembles_codes():
    hooks = TalkerHooks()
    session, shim_arena = _session(hooks)
    try:
        layers = {0: torch.ones(2, H), 24: torch.zeros(2, H)}
        payload = {"model_intermediate_buffer": {"hidden_states": {"layers": layers}, "meta": {"tag": "t"}}}
        layout = packed_layout(["r"], [0, 2], [0], [2])
        plan = session.step_begin(StepBegin(step=0, batch=layout, want_states=["r"],
                                            new_requests=[NewRequest("r", 2, [3, 3], payload)]))
        assert plan.errors == [] and plan.overlays == [] and session.model_hooks is None
        out = session.arenas.out.arena
        state = _read_tree(out, plan.model_states, plan.stacks)["r"]
        assert set(state["hidden_states"]["layers"]) == {0, 24}  # int keys survive the wire
        assert torch.equal(state["hidden_states"]["layers"][0], layers[0]) and state["meta"]["tag"] == "t"
        slots = HiddenSlots(shim_arena, 2)
        for step in (1, 2):
            slot = slots.claim(step, lambda s: None)
            codes = torch.tensor([[step, 5, 6]])
            (updates, outputs), tensors = _slot_trees(
                slot, {"r": {"meta": {"k": torch.ones(1)}, "codes": {"audio": codes}}}, {"r": {"codes": {"audio": codes}}})
            end = StepEnd(step=step, num_tokens=1, batch=packed_layout(None, [0, 1], [1 + step], [2]),
                          model_updates=updates, model_outputs=outputs, tensors=tensors)
            assert session.step_end(end).errors == []
            slot.sent()
        assert hooks.state.get("r")["codes"]["audio"].tolist() == [[2, 5, 6]]  # merged, a copy
        assert hooks.get_outputs("r")["codes.audio"].tolist() == [[1, 5, 6], [2, 5, 6]]
        bad = StepEnd(step=3, num_tokens=1, model_outputs=msgspec.msgpack.encode({"r": {"x": whole_mark(0)}}),
                      tensors=[TensorRef(0, 1 << 30, 4, [1], "float32")])
        assert "outside" in session.step_end(bad).errors[0].message  # every ref is checked
    finally:
        session.close()
        shim_arena.close()


def test_a_voice_cloning_talkers_reference_codes_are_published_once_as_vllm_omnis_talker_publishes_them():
    """Base: the model's preprocess writes `codes.ref` (and `meta.ref_code_len`) into the request's state at
    its prefill; the talker hook set makes them outputs of the same names, once, for the code2wav stage."""
    hooks = TalkerHooks()
    session, shim_arena = _session(hooks)
    try:
        payload = {"model_intermediate_buffer": {"meta": {"tag": "t"}}}
        session.step_begin(StepBegin(step=0, batch=packed_layout(["r"], [0, 2], [0], [2]), want_states=["r"],
                                     new_requests=[NewRequest("r", 2, [3, 3], payload)]))
        slots = HiddenSlots(shim_arena, 2)
        reference = torch.arange(12).reshape(4, 3)
        for step, update in ((1, {"codes": {"ref": reference}, "meta": {"ref_code_len": 4}}), (2, {"meta": {"k": 1}})):
            slot = slots.claim(step, lambda s: None)
            codes = torch.tensor([[step, 5, 6]])
            (updates, outputs), tensors = _slot_trees(slot, {"r": update}, {"r": {"codes": {"audio": codes}}})
            end = StepEnd(step=step, num_tokens=1, batch=packed_layout(None, [0, 1], [1 + step], [2]),
                          model_updates=updates, model_outputs=outputs, tensors=tensors)
            assert session.step_end(end).errors == []
            slot.sent()
        got = hooks.get_outputs("r")
        assert got["codes.ref"].tolist() == reference.tolist() and got["meta.ref_code_len"] == 4
        assert got["codes.audio"].tolist() == [[1, 5, 6], [2, 5, 6]]
    finally:
        session.close()
        shim_arena.close()


def test_requests_without_a_served_state_run_without_the_hooks():
    model = FakeTalker()
    bridge = ModelBridge(model, find_model_hooks(model))
    bridge.note_new("a", 5)
    bridge.note_new("p", 5)
    bridge.fill_states({}, failed={"p"})  # the sidecar failed p's payload; nobody served a
    batch = step_batch(["a", "p"], [2, 2], [0, 0], [3, 3, 3, 3])
    embeds = torch.ones(4, H)
    bridge.before_forward(batch, embeds)
    assert model.calls == [] and embeds.sum() == 4 * H  # token embeddings untouched
    assert bridge.after_forward(batch, torch.zeros(4, H)) == {} and model.calls == []
    bridge.note_finished({"a", "p"})
    assert bridge.missing_states(["a", "p"]) == ["a", "p"]


def test_requests_vllm_adds_during_its_warm_up_reach_no_hook_and_ask_no_state():
    """vLLM 0.26's V2 warm-up (`warmup_kernels`) adds `_warmup_{i}_` requests inside the worker's
    compile_or_warm_up_model; other releases use other ids. Marked by the phase, not the names."""
    from worker_shim.upstream.runner import SidecarRunnerMixin, swap_class
    from worker_shim.upstream.worker import ShimWorkerMixin

    model = FakeTalker()
    bridge = ModelBridge(model, find_model_hooks(model))

    class UpstreamRunner:
        def add_requests(self, scheduler_output):
            pass

    runner = UpstreamRunner()
    swap_class(runner, SidecarRunnerMixin)
    runner.omni_link = SimpleNamespace(note_new=lambda reqs: None)
    runner.omni_bridge = bridge

    def add(req_id):
        req = SimpleNamespace(req_id=req_id, prompt_len=3, prompt_token_ids=[0, 1, 2])
        runner.add_requests(SimpleNamespace(scheduled_new_reqs=[req]))

    class UpstreamWorker:
        def compile_or_warm_up_model(self):
            add("_warmup_0_")
            add("_sparse_mla_v2_warmup_prefill_")
            return "compilation times"

    worker = type("Worker", (ShimWorkerMixin, UpstreamWorker), {})()
    worker.model_runner = runner
    assert worker.compile_or_warm_up_model() == "compilation times"
    assert runner.omni_warming_up is False
    add("client-a")
    assert bridge.missing_states(["_warmup_0_", "_sparse_mla_v2_warmup_prefill_", "client-a"]) == ["client-a"]
    batch = step_batch(["_warmup_0_", "_sparse_mla_v2_warmup_prefill_"], [2, 1], [0, 2], [0, 1, 2])
    embeds = torch.ones(3, H)
    bridge.before_forward(batch, embeds)
    assert model.calls == [] and embeds.sum() == 3 * H
    assert bridge.after_forward(batch, torch.zeros(3, H)) == {} and model.calls == []
    bridge.note_finished({"_warmup_0_", "_sparse_mla_v2_warmup_prefill_"})
    assert bridge.missing_states(["_warmup_0_"]) == ["_warmup_0_"]


def test_sidecar_hooks_read_each_rows_input_ids_from_the_layout():
    from omni_sidecar.hook_api.hook_set import StepBatch
    from omni_sidecar.sessions.replays import SeenPositions

    layout = StepLayout(["a", "b"], [0, 2, 3], [0, 5], [2, 5], [11, 12, 42])
    assert StepBatch(0, layout).input_ids(1) == [42]  # b decodes the token sampled before
    seen = SeenPositions()
    seen.upto["a"] = 1  # a's first position was seen before a preemption
    fresh, _ = seen.fresh_rows(layout, None)
    assert fresh.input_ids == [12, 42] and StepBatch(0, fresh).input_ids(0) == [12]


def test_int_keyed_state_survives_the_hot_upgrade_hand_over():
    from omni_sidecar.upgrade.takeover_state import pack, unpack

    state = {"states": {"r": {"hidden_states": {"layers": {0: torch.ones(2), 24: torch.zeros(1)}}}}}
    back = unpack(pack(state))["states"]["r"]["hidden_states"]["layers"]
    assert set(back) == {0, 24} and torch.equal(back[0], torch.ones(2))
