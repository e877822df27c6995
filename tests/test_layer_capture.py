"""Layer capture without vLLM: the shim's pre-hooks, its arena slots, the sidecar's assembly,
and vllm-omni 0.30.0's own deserializer on what a client hands on."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from omni_sidecar.hook_sets.omni.keys import HIDDEN, LAYER_PREFIX, unflatten
from omni_sidecar.hook_sets.omni.wire import encode_additional_information
from proto.arena import ShmArena
from proto.messages import Hello, HookNeeds, NewRequest, StepEnd, StepResult, Welcome
from proto.packed import packed_layout
from proto.tensors import TensorRef
from proto.version import PROTOCOL_MAJOR
from tests.support.procs import SidecarProcess
from tests.support.vllm_omni_payload import as_its_wire, vllm_omni_payload_code
from tests.test_shim_units import write_hidden
from tests.test_sidecar import Peer
from worker_shim.errors import SidecarError
from worker_shim.model.embeds import EmbedsBuffer, embeds_width, wanted
from worker_shim.model.layers import LayerCapture
from worker_shim.step.slots import HiddenSlots

H = 8


class DecoderLayer(nn.Module):
    """vLLM's decoder-layer convention: (positions, hidden_states, residual) -> (out, residual),
    the residual add deferred to the next layer."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        self.proj = nn.Linear(H, H)
        torch.manual_seed(seed)
        nn.init.normal_(self.proj.weight)

    def forward(self, positions, hidden_states, residual):
        residual = hidden_states if residual is None else hidden_states + residual
        return self.proj(residual), residual


class TinyDecoder(nn.Module):
    def __init__(self, num_layers: int) -> None:
        super().__init__()
        self.vision = nn.ModuleDict({"layers": nn.ModuleList([nn.Identity()])})  # another "layers" list
        self.layers = nn.ModuleList([DecoderLayer(i) for i in range(num_layers)])

    def forward(self, positions, embeds, states: list | None = None):
        hidden, residual = embeds, None
        for i, layer in enumerate(self.layers):
            if states is not None:  # the logical decoder state entering layer i
                states.append(hidden.clone() if residual is None else hidden + residual)
            hidden, residual = layer(positions, hidden_states=hidden, residual=residual) if i % 2 \
                else layer(positions, hidden, residual)
        return hidden + residual


def test_pre_hooks_capture_the_state_entering_each_chosen_layer():
    model = TinyDecoder(4)
    capture = LayerCapture(model, 4, [3, 0, 1], max_tokens=16, width=H, dtype=torch.float32,
                           device=torch.device("cpu"))
    embeds = torch.randn(5, H)
    states: list[torch.Tensor] = []
    with torch.no_grad():
        model(torch.arange(5), embeds, states)
    rows = capture.rows(5)
    assert sorted(rows) == [0, 1, 3]
    for n, got in rows.items():
        torch.testing.assert_close(got, states[n])
    torch.testing.assert_close(rows[0], embeds)  # layer 0: the input embeddings
    capture.remove()
    with pytest.raises(SidecarError, match=r"layers 0\.\.3"):
        LayerCapture(model, 4, [4], 16, H, torch.float32, torch.device("cpu"))
    with pytest.raises(SidecarError, match="no decoder layer list of 5"):
        LayerCapture(model, 5, [0], 16, H, torch.float32, torch.device("cpu"))


def test_hidden_slots_carry_the_layers_after_the_hidden_states():
    arena = ShmArena.create(1 << 14, prefix="omni-test-layers")
    try:
        slots = HiddenSlots(arena, 2)
        hidden, layers = torch.randn(3, H), {0: torch.randn(3, H), 2: torch.randn(3, H)}
        ref, layer_refs, event = write_hidden(slots, 0, hidden, lambda s: None, layers)
        assert event == -1 and sorted(layer_refs) == [0, 2]
        from omni_arena.views import arena_tensor

        torch.testing.assert_close(arena_tensor(arena, ref), hidden)
        for n, layer_ref in layer_refs.items():
            assert layer_ref.offset >= ref.offset + ref.nbytes
            torch.testing.assert_close(arena_tensor(arena, layer_ref), layers[n])
        # Same shape, dtype and device: one stacked copy, the blocks back to back in layer order.
        assert [r.offset for r in (ref, layer_refs[0], layer_refs[2])] == [ref.offset + k * ref.nbytes for k in range(3)]
        views = len(slots._views)
        hidden2 = torch.randn(3, H)
        ref2, layer_refs2, _ = write_hidden(slots, 2, hidden2, lambda s: None, layers)  # slot 0 again: its view kept
        assert ref2 == ref and layer_refs2 == layer_refs and len(slots._views) == views
        torch.testing.assert_close(arena_tensor(arena, ref2), hidden2)
        # Rows of another shape: one copy each, each block aligned.
        odd = {0: torch.randn(3, H), 1: torch.randn(2, H)}
        ref3, layer_refs3, _ = write_hidden(slots, 1, hidden, lambda s: None, odd)
        for n, layer_ref in layer_refs3.items():
            assert layer_ref.offset % 64 == 0
            torch.testing.assert_close(arena_tensor(arena, layer_ref), odd[n])
        torch.testing.assert_close(arena_tensor(arena, ref3), hidden)
        with pytest.raises(SidecarError, match="exceed the arena slot"):
            write_hidden(slots, 3, hidden, lambda s: None, {n: torch.zeros(200, H) for n in range(2)})
        with pytest.raises(SidecarError, match="exceed the arena slot"):
            write_hidden(slots, 5, torch.zeros(200, H), lambda s: None, {n: torch.zeros(200, H) for n in range(2)})
    finally:
        arena.close()


def test_embeds_come_from_upstream_where_it_builds_them_and_have_its_width():
    assert not wanted("auto", "always", True) and not wanted("on", "prefill", True)
    assert embeds_width(SimpleNamespace(get_inputs_embeds_size=lambda: 96, get_hidden_size=lambda: 64)) == 96
    assert embeds_width(SimpleNamespace(get_hidden_size=lambda: 64)) == 64  # older vLLM


def test_overlays_go_into_the_embeds_upstream_merged_and_positions_pass_through():
    from worker_shim.upstream.runner import SidecarModelStateMixin, swap_class

    class UpstreamState:  # V2's model state: merged embeds (encoder rows in), M-RoPE positions
        def __init__(self) -> None:
            self.merged = torch.randn(16, H)

        def prepare_inputs_embeds(self, scheduled_encoder_inputs, input_batch, req_states):
            return self.merged[: input_batch.num_tokens_after_padding]

        def prepare_inputs(self, input_batch, req_states):
            return {"positions": torch.arange(3 * 5).view(3, 5)}

        def prepare_dummy_inputs(self, num_reqs, num_tokens):
            return {"inputs_embeds": self.merged[:num_tokens]}

    class Link:
        in_step = True
        seen: list = []

        def pre_forward(self, input_batch, model, embeds=None, bridge=None):
            self.seen.append(embeds)
            if embeds is None:
                return {}
            embeds[3:5] = 7.0  # what read_plan does with overlay rows
            return {"inputs_embeds": embeds}

    state, link = UpstreamState(), Link()
    swap_class(state, SidecarModelStateMixin)
    # A shim embeds buffer next to upstream's (model hooks want one): upstream's wins, in graphs too.
    buffer = EmbedsBuffer(16, H, torch.float32, torch.device("cpu"))
    state.omni_runner = SimpleNamespace(omni_link=link, omni_embeds=buffer, omni_tp=None, model=None,
                                        omni_bridge=None)
    batch = SimpleNamespace(num_tokens_after_padding=5, num_tokens=5)
    before = state.merged.clone()
    merged = state.prepare_inputs_embeds({}, batch, None)
    inputs = state.prepare_inputs(batch, None)
    assert inputs["inputs_embeds"] is merged and merged.data_ptr() == state.merged.data_ptr()
    assert torch.equal(state.merged[3:5], torch.full((2, H), 7.0))
    assert torch.equal(state.merged[:3], before[:3]) and torch.equal(state.merged[5:], before[5:])
    assert torch.equal(inputs["positions"], torch.arange(15).view(3, 5))  # untouched
    assert state.prepare_dummy_inputs(1, 4)["inputs_embeds"].data_ptr() == state.merged.data_ptr()
    state.omni_runner.omni_embeds = None
    state.prepare_inputs(batch, None)  # a step without the embeds seam (a dummy run): nothing kept
    assert link.seen[-1] is None


@pytest.fixture(scope="module")
def its():
    with vllm_omni_payload_code() as code:
        yield code


def test_layers_over_the_wire_assemble_per_request_for_vllm_omni(tmp_path, its):
    from omni_sidecar.client import SidecarClient

    proc = SidecarProcess(f"ipc://{tmp_path}/s.sock", "omni", tmp_path / "sidecar.log",
                          options=["hidden_layers=2,0"])
    arena = ShmArena.create(1 << 16)
    peer = Peer(proc.endpoint)
    try:
        welcome = peer.call(Hello(PROTOCOL_MAJOR, 0, "test", "none", "cpu", 0, 1, "m", H, "float32", 16, [arena.info()]))
        assert isinstance(welcome, Welcome) and welcome.needs.hidden_layers == [0, 2]
        new = [NewRequest("a", 3, [1, 2, 3]), NewRequest("b", 2, [4, 5])]
        steps = [(["a", "b"], [0, 3, 5], [0, 0], [3, 2], new), (["a", "b"], [0, 1, 2], [3, 2], [3, 2], [])]
        sent: dict[int, list[torch.Tensor]] = {0: [], 2: []}
        for step, (ids, qsl, computed, prefill, reqs) in enumerate(steps):
            layout, n = packed_layout(ids, qsl, computed, prefill), qsl[-1]
            refs, offset = {}, 0
            for index, tensor in [(-1, torch.randn(n, H))] + [(i, torch.randn(n, H)) for i in (0, 2)]:
                arena.raw(offset, n * H * 4)[:] = tensor.numpy().tobytes()
                refs[index] = TensorRef(0, offset, n * H * 4, [n, H], "float32")
                offset += 4096
                if index >= 0:
                    sent[index].append(tensor)
            result = peer.call(StepEnd(step, layout, reqs, hidden=refs.pop(-1), hidden_layers=refs, num_tokens=n))
            assert isinstance(result, StepResult) and result.errors == []
        with SidecarClient(proc.endpoint) as client:
            outputs = {r: client.outputs(r) for r in ("a", "b")}
        for r, rows in (("a", [(0, 3), (0, 1)]), ("b", [(3, 5), (1, 2)])):
            flat = {k: v for k, v in outputs[r].items() if k.startswith(f"{HIDDEN}.{LAYER_PREFIX}")}
            nested = unflatten(flat)  # {"hidden_states": {"layers": {0: t, 2: t}}}
            got = its.data_entry_keys.deserialize_payload(as_its_wire(encode_additional_information(nested), its.engine))
            assert sorted(got["hidden_states"]["layers"]) == [0, 2]
            for index in (0, 2):
                want = torch.cat([sent[index][s][a:b] for s, (a, b) in enumerate(rows)])
                assert torch.equal(got["hidden_states"]["layers"][index], want)
        # A layer the hooks did not ask for fails the step's requests, and the sidecar serves on.
        ref = TensorRef(0, 0, 4 * H, [1, H], "float32")
        bad = peer.call(StepEnd(2, packed_layout(["a"], [0, 1], [4], [3]), hidden=ref, hidden_layers={1: ref},
                                num_tokens=1))
        assert [e.req_id for e in bad.errors] == ["a"] and "hidden layers [1]" in bad.errors[0].message
    finally:
        peer.close()
        arena.close()
        proc.stop()


def test_hook_needs_name_layers_as_ints():
    import msgspec

    needs = msgspec.msgpack.decode(msgspec.msgpack.encode(HookNeeds(hidden_layers=[0, 24])), type=HookNeeds)
    assert needs.hidden_layers == [0, 24]
    with pytest.raises(msgspec.ValidationError):
        msgspec.msgpack.decode(msgspec.msgpack.encode({"hidden_layers": [-1]}), type=HookNeeds)


def test_graphs_with_capture_hooks_get_their_own_compile_cache_key():
    from worker_shim.model.embeds import GRAPH_KEY, LAYERS_GRAPH_KEY, mark_compiled_graph

    cfg = SimpleNamespace(additional_config={})
    mark_compiled_graph(cfg, LAYERS_GRAPH_KEY, [0, 24])
    assert cfg.additional_config == {LAYERS_GRAPH_KEY: [0, 24]} and GRAPH_KEY != LAYERS_GRAPH_KEY
