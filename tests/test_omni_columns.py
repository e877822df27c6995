"""The omni set's state columns: `merge_columns` does what one `merge` per request does, and the
rows a step's batched postprocess leaves in the states never keep a whole past step alive."""

from __future__ import annotations

import torch

from omni_sidecar.hook_api.hook_set import HookErrors, RequestInfo, StepBatch
from omni_sidecar.hook_sets.omni.state_hooks import OmniStateHooks
from omni_sidecar.hook_sets.omni.state import IntermediateBuffer, StateError
from proto.packed import StepLayout, packed_layout
from tests.support.trees import assert_same_tree
from proto.version import PROTOCOL_MAJOR


def _buffers(cap: int) -> tuple[IntermediateBuffer, IntermediateBuffer]:
    pair = IntermediateBuffer(max_bytes_per_request=cap), IntermediateBuffer(max_bytes_per_request=cap)
    for buf in pair:
        buf.create("a", {"meta": {"n": 1}, "hidden_states": {"last": torch.zeros(1, 4)}})
        buf.create("b", {"meta": 7})  # a category that is not a dict: the general rules
        buf.create("c", {"meta": {"n": 1}, "big": {"t": torch.zeros(30)}})  # near the cap
    return pair


def test_merge_columns_equals_one_merge_per_request():
    columns = {("meta", "n"): [2, 3, 4, 5], ("hidden_states", "last"): [torch.full((1, 4), float(i)) for i in range(4)]}
    req_ids = ["a", "b", "c", "gone"]
    by_columns, by_merge = _buffers(cap=130)
    refused = by_columns.merge_columns(req_ids, columns)
    merge_errors = {}
    for i, req_id in enumerate(req_ids):
        try:
            by_merge.merge(req_id, {"meta": {"n": columns["meta", "n"][i]},
                                    "hidden_states": {"last": columns["hidden_states", "last"][i]}})
        except StateError as exc:
            merge_errors[req_id] = str(exc)
    assert refused == merge_errors and set(refused) == {"c"}  # c's 120 + 16 bytes are over 130
    for req_id in "abc":
        assert_same_tree(by_columns.get(req_id), by_merge.get(req_id))
        assert by_columns.nbytes(req_id) == by_merge.nbytes(req_id)
    assert by_columns.get("c")["meta"] == {"n": 1}  # all or nothing: the refused request is as it was


def test_merge_columns_keeps_the_span_rules():
    buf = IntermediateBuffer()
    buf.create("a", {"embed": {"decode": torch.ones(2, 3), "decode_token_start": 0, "decode_token_end": 2}})
    refused = buf.merge_columns(["a"], {("embed", "decode"): [torch.zeros(2, 3)],
                                        ("embed", "decode_token_start"): [1], ("embed", "decode_token_end"): [3]})
    assert refused == {} and buf.get("a")["embed"]["decode"].shape == (3, 3)  # overlap trimmed, one row appended
    refused = buf.merge_columns(["a"], {("embed", "decode"): [torch.zeros(1, 3)],
                                        ("embed", "decode_token_start"): [9], ("embed", "decode_token_end"): [10]})
    assert "gap" in refused["a"]


def test_a_request_that_leaves_the_batch_keeps_its_rows_in_storage_of_its_own():
    hooks = OmniStateHooks()
    hooks.on_new_requests([RequestInfo(r, 2, [1, 2], None) for r in "abc"])

    def step(n: int, ids: list[str]) -> None:
        batch = StepBatch(n, StepLayout(ids, list(range(len(ids) + 1)), [2 + n] * len(ids), [2] * len(ids)))
        hooks.process_model_output(batch, torch.randn(len(ids), 4))

    def storage(req_id: str) -> int:
        return hooks.state.get(req_id)["hidden_states"]["last"].untyped_storage().nbytes()

    step(0, ["a", "b", "c"])
    assert storage("a") == 3 * 4 * 4  # rows of the step's one gather, not a copy each
    step(1, ["a", "c"])  # b preempted, say
    assert storage("b") == 4 * 4 == hooks.state.nbytes("b")  # its own row only
    assert storage("a") == 2 * 4 * 4
    assert hooks.state.get("b")["meta"]["num_processed_tokens"] == 1


def test_between_steps_work_waits_for_the_message_already_in_the_ring():
    """Once a StepEnd is answered the sidecar builds the next plan ahead, then cuts the outputs
    (`between_steps`), unless the shim's next message already waits in the ring: that one is
    answered first."""
    from types import SimpleNamespace

    from omni_sidecar.hook_api.hook_set import OmniHooks
    from omni_sidecar.serve.metrics import SidecarMetrics
    from omni_sidecar.serve.peers import ShimPeer
    from omni_sidecar.sessions.session import Session
    from omni_sidecar.sessions.store import FinishedOutputs
    from proto.messages import Hello

    class Counting(OmniHooks):
        calls = 0

        def between_steps(self):
            self.calls += 1

    hooks = Counting()
    session = Session(1, Hello(PROTOCOL_MAJOR, 0, "t", "none", "cpu", 0, 1, "m", 4, "float32", 8, []), hooks,
                      FinishedOutputs(4), SidecarMetrics())
    peer = ShimPeer(b"shim", session, listener=None, codec=None)  # type: ignore[arg-type]
    waiting = [True]
    peer.rings = SimpleNamespace(closed=False, duplex=SimpleNamespace(rx=SimpleNamespace(has_data=lambda: waiting[0])))
    peer.after_step_end()
    assert hooks.calls == 0 and peer.between_steps_due  # the StepBegin in the ring goes first
    peer.between_steps()  # what the server does once it answered that message
    peer.between_steps()
    assert hooks.calls == 1 and not peer.between_steps_due
    waiting[0] = False
    peer.after_step_end()
    assert hooks.calls == 2  # nothing waits: at once
    # Hooks that put nothing off (the base's no-op): nothing deferred, nothing to run later.
    idle = ShimPeer(b"shim2", Session(2, session.hello, OmniHooks(), FinishedOutputs(4), SidecarMetrics()),
                    listener=None, codec=None)  # type: ignore[arg-type]
    idle.rings, waiting[0] = peer.rings, True
    idle.after_step_end()
    assert not idle.session.works_between_steps and not idle.between_steps_due


def test_a_refused_request_and_one_without_state_keep_nothing_of_the_step():
    """A request the cap refuses keeps its earlier row in storage of its own (not a view of a past
    step's gather); a request whose state is gone gets no output chunk (as when postprocess ran
    per request)."""
    hooks = OmniStateHooks()
    ids = ["a", "b", "c"]
    hooks.on_new_requests([RequestInfo(r, 2, [1, 2], None) for r in ids])

    def step(n: int) -> None:
        batch = StepBatch(n, StepLayout(ids, [0, 1, 2, 3], [2 + n] * 3, [2] * 3))
        try:
            hooks.process_model_output(batch, torch.randn(3, 4))
        except HookErrors as exc:
            assert set(exc.errors) == {"a"} and "over the cap" in exc.errors["a"]

    step(0)
    hooks.state.free("c")
    chunks_c = len(hooks.output_chunks("c"))
    hooks.state.max_bytes = hooks.state.nbytes("a")  # the next row would not fit... for anyone
    hooks.state._sizes["a"] += 1  # ... and a is one byte over: refused
    step(1)
    last_a = hooks.state.get("a")["hidden_states"]["last"]
    assert last_a.untyped_storage().nbytes() == last_a.nbytes == 16  # owned, not step 0's 48-byte gather
    assert len(hooks.output_chunks("c")) == chunks_c  # no state: no chunk
    assert len(hooks.output_chunks("a")) == 1 and len(hooks.output_chunks("b")) == 2


def test_errors_of_the_work_between_steps_go_out_with_the_next_answer():
    from omni_sidecar.hook_api.hook_set import HookErrors, OmniHooks
    from omni_sidecar.serve.metrics import SidecarMetrics
    from omni_sidecar.sessions.session import Session
    from omni_sidecar.sessions.store import FinishedOutputs
    from proto.messages import Hello, NewRequest, StepBegin, StepEnd

    class Failing(OmniHooks):
        def between_steps(self):
            raise HookErrors({"r": "cutting outputs failed"})

    session = Session(1, Hello(PROTOCOL_MAJOR, 0, "t", "none", "cpu", 0, 1, "m", 4, "float32", 8, []), Failing(),
                      FinishedOutputs(4), SidecarMetrics())
    layout = packed_layout(["r"], [0, 2], [0], [2])
    session.step_begin(StepBegin(0, layout, new_requests=[NewRequest("r", 2, [1, 2])]))
    assert session.step_end(StepEnd(0, None, num_tokens=2)).errors == []
    session.between_steps()
    result = session.step_end(StepEnd(1, None, num_tokens=0))
    assert [(e.req_id, e.message) for e in result.errors] == [("r", "cutting outputs failed")]
    assert session.step_end(StepEnd(2, None, num_tokens=0)).errors == []  # sent once


def _step(hooks: OmniStateHooks, n: int, ids: list[str], rows: list[int], device: torch.device) -> None:
    qsl = [0]
    for k in rows:
        qsl.append(qsl[-1] + k)
    batch = StepBatch(n, StepLayout(ids, qsl, [2 + n] * len(ids), [2] * len(ids)))
    batch.hidden_layers = {0: torch.randn(qsl[-1], 4, device=device)}
    hooks.process_model_output(batch, torch.randn(qsl[-1], 4, device=device))


def test_the_last_hidden_row_stays_where_the_rows_are_unless_told_otherwise():
    """By default `hidden_states.last` is device-resident (vllm-omni's talkers declare it so): the
    next plan sends it back to the device. `resident_keys=` (none) moves it to host memory, as
    vllm-omni does with keys a model does not declare. Here the "device" is the CPU and the host
    `meta`, so that where each row went is seen on a machine without a GPU."""
    kept = {}
    for option in (None, ""):
        hooks = OmniStateHooks() if option is None else OmniStateHooks(resident_keys=option)
        hooks.state.host_device, hooks.state._host_is_cpu = torch.device("meta"), False
        hooks.on_new_requests([RequestInfo(r, 2, [1, 2], None) for r in "ab"])
        _step(hooks, 1, ["a", "b"], [1, 1], torch.device("cpu"))
        kept[option] = {r: hooks.state.get(r)["hidden_states"]["last"].device.type for r in "ab"}
    assert kept == {None: {"a": "cpu", "b": "cpu"}, "": {"a": "meta", "b": "meta"}}


def test_the_omni_step_never_waits_for_the_device():
    """On a GPU: the sidecar's StepEnd (prefill and decode), its next plan (extra kwargs stacked into
    a CUDA IPC arena, and a host tensor staged and copied up: a decoded payload's overlay rows, a
    state kept on the host) and the work between steps, then the shim's copy of the plan out, enqueue
    their device work without one host synchronize (a synchronize there waits for the step's forward,
    and the shim then waits for it too). Skipped without a CUDA device: run on the GPU host."""
    import pytest

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device (run on the GPU host)")
    from omni_arena.cuda_ipc import CudaIpcArena
    from omni_arena.tensor_tree import TreeDecoder, TreeEncoder
    from omni_arena.views import arena_tensor
    from omni_sidecar.sessions.arenas import OutArena

    dev = torch.device("cuda", 0)
    ids = [f"r{i}" for i in range(10)]
    hooks = OmniStateHooks(extra_kwargs="1", hidden_layers="0")
    hooks.on_new_requests([RequestInfo(r, 2, [1, 2], None) for r in ids])
    arena = CudaIpcArena.create(1 << 20, dev, 1, name="omni-test-nosync")
    try:
        out = OutArena(arena)
        _step(hooks, 0, ids, [2] * len(ids), dev)  # warm-up: the pinned pool, the allocator
        torch.cuda.synchronize(dev)
        torch.cuda.set_sync_debug_mode("error")
        try:
            for n, rows in enumerate([[2] * len(ids), [1] * len(ids), [1] * len(ids)], start=1):
                _step(hooks, n, ids, rows, dev)
                batch = StepBatch(n + 1, StepLayout(ids, list(range(len(ids) + 1)), [3 + n] * len(ids), [2] * len(ids)))
                out.reset()
                tree = {**hooks.build_extra_kwargs(batch), "staged": torch.full((4,), float(n))}
                sent = TreeEncoder().encode(tree, out.put_whole, out.put_stack)
                out.seal()
                hooks.between_steps()
                stacks = out.stacks
                got = TreeDecoder(len(stacks), lambda k: arena_tensor(arena, stacks[k]).clone()).decode(sent)
                host = got.pop("staged")
                arena.mark_done(0)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize(dev)
        last = [info["hidden_states"]["last"] for info in got["runtime_additional_information"]]
        assert {t.device for t in last} == {dev} and len(last) == len(ids)
        for r, t in zip(ids, last):
            assert torch.equal(t, hooks.state.get(r)["hidden_states"]["last"])
        assert out.stacks, "the rows went as one stack"
        assert host.device == dev and host.tolist() == [3.0] * 4  # the last plan's staged tensor
    finally:
        arena.close()


def test_finished_outputs_are_assembled_when_first_read_and_are_the_live_ones(monkeypatch):
    """A batch that finishes in one step does not assemble every request's outputs in that step (a
    client may never ask): the omni set's outputs are its chunks put together when first read."""
    import omni_sidecar.hook_sets.omni.state_hooks as omni_hooks
    from omni_sidecar.serve.metrics import SidecarMetrics
    from omni_sidecar.sessions.session import Session
    from omni_sidecar.sessions.store import FinishedOutputs
    from proto.arena import ShmArena
    from proto.messages import Hello, NewRequest, StepEnd
    from proto.tensors import TensorRef

    assembled = []
    real = omni_hooks.accumulate
    monkeypatch.setattr(omni_hooks, "accumulate", lambda chunks: assembled.append(1) or real(chunks))
    arena = ShmArena.create(1 << 16, prefix="omni-test-lazy")
    hello = Hello(PROTOCOL_MAJOR, 0, "test", "none", "cpu", 0, 1, "m", 4, "float32", 8, [arena.info()])
    store = FinishedOutputs(10)
    session = Session(1, hello, OmniStateHooks(), store, SidecarMetrics())
    try:
        session.open_arenas()
        arena.view(TensorRef(0, 0, 64, [64], "uint8"))[:] = torch.arange(16, dtype=torch.float32).numpy().tobytes()
        rows = TensorRef(0, 0, 32, [2, 4], "float32")
        ids = ["a", "b"]
        session.step_end(StepEnd(0, packed_layout(ids, [0, 1, 2], [0, 0], [1, 1]), [NewRequest(r, 1, [1]) for r in ids],
                                 hidden=rows, num_tokens=2))
        session.step_end(StepEnd(1, packed_layout(ids, [0, 1, 2], [1, 1], [1, 1]), hidden=rows, num_tokens=2))
        live = {r: session.hooks.get_outputs(r) for r in ids}
        assembled.clear()
        session.step_end(StepEnd(2, None, finished=ids))
        assert assembled == [], "outputs assembled in the step the requests finished"
        for r in ids:
            assert_same_tree(store.get(r).outputs, live[r])
            assert store.get(r).outputs["hidden_states"].shape == (2, 4)
        assert len(assembled) == 2  # once each, kept
    finally:
        session.close()
        arena.close()



def test_a_requests_chunks_are_cut_when_read_once(monkeypatch):
    """Steps' outputs are logged whole; a request's chunk of a step is cut when something reads
    it, once (the same chunk objects on the next read), and equal what cutting at once gives."""
    from omni_sidecar.hook_sets.omni.outputs import _LoggedStep

    cuts = []
    real = _LoggedStep.chunk
    monkeypatch.setattr(_LoggedStep, "chunk", lambda self, i: cuts.append(i) or real(self, i))
    hooks = OmniStateHooks(hidden_layers="0")
    hooks.on_new_requests([RequestInfo(r, 2, [1, 2], None) for r in "ab"])
    gen = torch.Generator().manual_seed(1)
    steps = []
    for n in range(3):
        hidden = torch.randn(2, 4, generator=gen)
        steps.append(hidden)
        batch = StepBatch(n, StepLayout(["a", "b"], [0, 1, 2], [2 + n] * 2, [2] * 2))
        batch.hidden_layers = {0: hidden * 2}
        hooks.process_model_output(batch, hidden.clone())
        hooks.between_steps()
    assert cuts == []
    first = hooks.output_chunks("a")
    assert cuts == [0, 0, 0] and hooks.output_chunks("a") is first and cuts == [0, 0, 0]
    assert [torch.equal(c["hidden_states"], h[0:1]) for c, h in zip(first, steps)] == [True] * 3
    assert [c["processed_trace"].tolist() for c in first] == [[[0, 1]], [[1, 1]], [[2, 1]]]
    hooks.on_finished(["b"])
    assert cuts == [0, 0, 0]  # a finished request nobody reads is never cut

def test_outputs_that_fail_to_assemble_become_the_requests_error_when_read():
    from omni_sidecar.sessions.store import FinishedEntry, FinishedOutputs

    def bad():
        raise RuntimeError("Sizes of tensors must match")

    store = FinishedOutputs(4)
    store.put("a", FinishedEntry(None, None, deferred=bad))
    entry = store.get("a", pop=True)
    assert entry.outputs is None and entry.chunks is None
    assert entry.error == "outputs: RuntimeError: Sizes of tensors must match"


def test_an_overrides_state_row_never_views_the_shims_hidden_rows():
    """A subclass's postprocess may return a view of its rows (the default clones); with the key
    resident it would keep viewing the shim's slot, which the next steps rewrite."""

    class Viewing(OmniStateHooks):
        def postprocess(self, req_id, hidden_rows, state):
            return {"hidden_states": {"last": hidden_rows[-1:]}}, None

    hooks = Viewing()
    hooks.on_new_requests([RequestInfo("a", 3, [1, 2, 3], None)])
    slot = torch.ones(8, 4)  # the shim's slot holds more than the step's rows
    hooks.process_model_output(StepBatch(0, StepLayout(["a"], [0, 3], [0], [3])), slot[:3])
    slot.fill_(7.0)  # the shim reuses its slot
    assert torch.equal(hooks.state.get("a")["hidden_states"]["last"], torch.ones(1, 4))


def test_a_logged_step_keeps_only_what_its_chunks_take():
    from omni_sidecar.hook_sets.omni.outputs import _LoggedStep

    per_request = ["x", "y"]
    step = _LoggedStep({"rows": torch.zeros(3, 2), "other": torch.zeros(5, 2), "per_request": per_request,
                        "scalar": 4}, [0, 2, 3], 2, {})
    per_request[0] = "changed by the hook later"
    assert sorted(step.outputs) == ["per_request", "rows"]
    assert step.chunk(0)["per_request"] == "x" and step.chunk(1)["rows"].shape == (1, 2)
