"""Per-step tensor moves of the omni path, batched: the state's running size, the sidecar's staged
host tensors (one copy up per plan) and the shim's one copy out per plan.

The CUDA check at the end runs on a GPU host (`python -m tests.test_plan_transfer` there);
on CPU it is reported as skipped, never as passed.
"""

from __future__ import annotations

import msgspec
import pytest
import torch

from omni_sidecar.sessions.arenas import OutArena
from omni_sidecar.hook_sets.omni.state import IntermediateBuffer, StateError, _nbytes
from proto.arena import ShmArena
from proto.tensors import TensorRef, TensorRefError
from tests.support.arenas import DeviceLikeArena
from tests.support.trees import assert_same_tree
from worker_shim.errors import SidecarError
from omni_arena.tensor_tree import TreeEncoder
from proto.plan_trees import encode_tree, row_mark, whole_mark
from worker_shim.step.plan_read import decode_plan_tree, kwargs_decoder

ROWS = 8  # requests in the trees below: each per-request tensor a row of one stack


def _copy_out_tree(arena, data: bytes, device, stacks=(), landing=None):
    """The shim's copy-out of a plan's extra kwargs: its stacks in one copy, the tree decoded."""
    return decode_plan_tree(kwargs_decoder(arena, list(stacks), device, landing), data, dict)


def _store(tree: dict, out: OutArena) -> bytes:
    """`tree` into the out-arena as the sidecar stores a plan's tree: bytes, every tensor an extension
    value naming a stack."""
    return TreeEncoder().encode(tree, out.put_whole, out.put_stack, len(out.stacks))


def test_the_state_size_kept_by_merges_equals_sizing_it_afresh():
    buf = IntermediateBuffer(max_bytes_per_request=10_000)
    buf.create("r", {"meta": {"prompt_len": 3}, "embed": {"prefill": torch.zeros(3, 4)}})
    steps = [
        ({"hidden_states": {"last": torch.zeros(1, 4)}}, False),
        ({"hidden_states": {"last": torch.zeros(1, 8)}}, False),  # replaced: 32 -> 64 bytes
        ({"embed": {"decode": torch.ones(2, 4), "decode_token_start": 0, "decode_token_end": 2}}, False),
        ({"embed": {"decode": torch.ones(3, 4), "decode_token_start": 1, "decode_token_end": 4}}, False),  # overlap
        ({"codes": torch.zeros(5, dtype=torch.int64)}, False),  # a category holding a tensor
        ({"codes": {"audio": torch.zeros(2, 2)}}, False),  # ... then a dict
        ({"meta": {"num_processed_tokens": 7}, "hidden_states": {"x": torch.zeros(3)}}, True),  # replace mode
    ]
    for update, replace in steps:
        buf.merge("r", update, replace=replace)
        assert buf.nbytes("r") == _nbytes(buf.get("r"))
    before = buf.nbytes("r")
    with pytest.raises(StateError, match="over the cap"):
        buf.merge("r", {"big": {"t": torch.zeros(20_000, dtype=torch.uint8)}})
    buf.merge("r", {"embed": {"decode": torch.ones(2, 4), "decode_token_start": 0, "decode_token_end": 2}})
    before = buf.nbytes("r")
    with pytest.raises(StateError):  # a span gap
        buf.merge("r", {"embed": {"decode": torch.ones(1, 4), "decode_token_start": 9, "decode_token_end": 10}})
    assert buf.nbytes("r") == before == _nbytes(buf.get("r"))
    buf.restore("h", {"a": {"b": torch.zeros(6)}})
    assert buf.nbytes("h") == 24
    buf.free("h")
    assert buf.nbytes("h") == 0


def _tree() -> dict:
    return {
        "runtime_additional_information": [
            {"meta": {"n": i}, "hidden_states": {"last": torch.full((1, 3), float(i))}} for i in range(ROWS + 1)
        ],
        "codes": torch.arange(7, dtype=torch.int64),
        "mask": torch.tensor([True, False, True]),
        "half": torch.ones(2, 2, dtype=torch.bfloat16),
        "empty": torch.zeros(0, 4),
        "scalar": torch.tensor(2.5),
        "spans": [[0, 1], [1, 2]],
        "transposed": torch.arange(6.0).view(2, 3).t(),  # not contiguous: its values, not its bytes in order
        "neg": torch.arange(3.0)._neg_view(),  # a lazy negation: the values, not the stored bytes
    }


def test_a_plans_tensors_come_out_of_the_shm_arena_in_one_copy_and_own_their_bytes():
    arena = ShmArena.create(1 << 16, prefix="omni-test-plan")
    try:
        out = OutArena(arena)
        want = _tree()
        sent = _store(want, out)
        # The [1, 3] rows are one stack; every other tensor is alone of its kind: a stack of one row,
        # or used whole (the empty one).
        assert len(out.stacks) == 8
        got = _copy_out_tree(arena, sent, torch.device("cpu"), out.stacks)
        assert_same_tree(got, want)
        arena.view(TensorRef(0, 0, arena.size, [arena.size], "uint8"))[:] = b"\xff" * arena.size
    finally:
        out.close()
    assert arena._mm.closed  # the out-arena let go of its view of the bytes: the mapping is gone
    assert_same_tree(got, want)  # copies, not views of the arena (closed and rewritten)


def test_a_ref_outside_the_arena_is_refused_before_anything_is_copied():
    arena = ShmArena.create(4096, prefix="omni-test-plan")
    try:
        from proto.messages import StepPlan
        from worker_shim.step.plan_read import read_plan

        tree = encode_tree({"x": whole_mark(0)})
        with pytest.raises(TensorRefError):
            _copy_out_tree(arena, tree, torch.device("cpu"), [TensorRef(0, 4000, 400, [100], "float32")])
        with pytest.raises(SidecarError, match="no arena"):
            read_plan(None, StepPlan(0, extra_kwargs=tree, stacks=[TensorRef(0, 0, 4, [1], "float32")]), None,
                      torch.nn.Linear(1, 1), None)
    finally:
        arena.close()


def test_refs_of_several_dtypes_off_the_arenas_alignment_read_right_and_bad_ones_are_step_errors():
    """The sidecar's arena aligns every tensor to 64 bytes, but a peer's refs are untrusted: refs
    aligned only to their own dtype (a byte at 1, int32 at 4) still read their bytes; a zero-byte
    ref whose shape overflows, or extra kwargs that are one tensor, are the step's error, never an
    exception the worker does not expect."""
    from proto.messages import StepPlan
    from worker_shim.step.plan_read import read_plan

    arena = ShmArena.create(4096, prefix="omni-test-plan")
    try:
        arena.view(TensorRef(0, 0, 12, [12], "uint8"))[:] = bytes([9, 1, 2, 3, 7, 0, 0, 0, 8, 0, 0, 0])
        stacks = [TensorRef(0, 1, 3, [3], "uint8"), TensorRef(0, 4, 8, [2], "int32")]
        got = _copy_out_tree(arena, encode_tree({"b": whole_mark(0), "i": whole_mark(1)}), torch.device("cpu"), stacks)
        assert got["b"].tolist() == [1, 2, 3] and got["i"].tolist() == [7, 8]
        huge = [TensorRef(0, 0, 0, [0] + [1 << 40] * 7, "float32")]
        with pytest.raises(SidecarError, match="cannot be read"):
            _copy_out_tree(arena, encode_tree({"x": whole_mark(0)}), torch.device("cpu"), huge)
        one_tensor = StepPlan(step=0, extra_kwargs=encode_tree(whole_mark(0)), stacks=stacks[1:])
        with pytest.raises(SidecarError, match="cannot be read"):  # kwargs that are no dict
            read_plan(arena, one_tensor, None, torch.nn.Linear(1, 1), None)
    finally:
        arena.close()


def test_host_tensors_bound_for_a_device_arena_go_up_in_one_copy_around_device_writes():
    arena = DeviceLikeArena(1 << 16)
    out = OutArena(arena)
    host = [torch.full((3, 5), float(i)) for i in range(4)] + [torch.arange(3000, dtype=torch.int64)]  # grows staging
    refs = [out.put(host[0]), out.put(host[1]), out.put(torch.empty(64, device="meta")),
            out.put(host[2]), out.put(host[3])]
    rows = [torch.full((2,), float(i)) for i in range(5)]
    stack = out.stacks[out.put_stack(rows)]  # host rows stacked into the staged run
    refs.append(out.put(host[4]))
    assert out.seal() == 0 and arena.ready_marks == 1
    (dev_off, dev_n), = arena.device_writes
    assert bool((arena.buf[dev_off : dev_off + dev_n] == 0xAB).all()), "a flush overwrote a device write"
    for ref, t in zip([refs[0], refs[1], refs[3], refs[4], refs[5]], host):
        raw = arena.buf[ref.offset : ref.offset + ref.nbytes]
        assert torch.equal(raw.view(t.dtype).view(t.shape), t)
        assert ref.shape == list(t.shape)
    assert torch.equal(arena.buf[stack.offset : stack.offset + stack.nbytes].view(torch.float32).view(stack.shape),
                       torch.stack(rows))
    out.reset()
    ref = out.put(torch.tensor([7.0]))
    assert ref.offset == 0 and out.seal() == 0
    assert arena.buf[0:4].view(torch.float32).item() == 7.0


def _on_cpu(value):
    if isinstance(value, torch.Tensor):
        return value.cpu()
    if isinstance(value, dict):
        return {k: _on_cpu(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_on_cpu(v) for v in value]
    return value


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run on the GPU host)")
def test_cuda_ipc_plan_round_trip_with_host_and_device_tensors():
    from omni_arena.cuda_ipc import CudaIpcArena

    dev = torch.device("cuda", 0)
    arena = CudaIpcArena.create(1 << 20, dev, 1, name="omni-test-plan")
    try:
        out = OutArena(arena)
        want = _tree()
        want["on_device"] = torch.arange(10, dtype=torch.float32, device=dev)
        want["more_host"] = torch.full((4, 4), 3.0)
        for step in range(4):  # reuse across steps: reset waits, staging is rewritten
            out.reset()
            want["codes"] = torch.arange(7, dtype=torch.int64) + step
            want["rows_on_device"] = [torch.full((2,), float(i), device=dev) for i in range(ROWS)]
            sent = _store(want, out)
            out.seal()
            got = _copy_out_tree(arena, sent, dev, out.stacks)
            torch.cuda.synchronize(dev)
            assert got["on_device"].device == dev
            assert_same_tree(got, _on_cpu(want))
            arena.mark_done(0)
    finally:
        arena.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run on the GPU host)")
def test_cuda_ipc_plans_land_in_the_shims_device_buffers_in_turn():
    """Plans read through a PlanLanding on the device: each step's values are its plan's, the
    step before keeps its values (a buffer each, in turn), and a steady step reuses its views."""
    from omni_arena.cuda_ipc import CudaIpcArena
    from worker_shim.step.plan_read import PlanLanding

    dev = torch.device("cuda", 0)
    arena = CudaIpcArena.create(1 << 20, dev, 1, name="omni-test-landing")
    landing = PlanLanding()
    try:
        out, kept = OutArena(arena), []
        for step in range(5):
            out.reset()
            want = {"rows": [torch.full((1, 8), float(step * 10 + i), device=dev) for i in range(ROWS)],
                    "host": torch.full((3,), float(step))}
            sent = _store(want, out)
            out.seal()
            got = _copy_out_tree(arena, sent, dev, out.stacks, landing)
            arena.mark_done(0)
            torch.cuda.synchronize(dev)
            assert_same_tree(_on_cpu(got), _on_cpu(want))
            if kept:
                assert_same_tree(_on_cpu(kept[-1][0]), kept[-1][1])
            if step >= 2:
                assert all(a is b for a, b in zip(got["rows"], kept[-2][0]["rows"]))
            kept.append((got, _on_cpu(want)))
    finally:
        landing.close()
        arena.close()


if __name__ == "__main__":  # the GPU host, without pytest
    test_cuda_ipc_plan_round_trip_with_host_and_device_tensors()
    test_host_tensors_bound_for_a_device_arena_go_up_in_one_copy_around_device_writes()
    test_cuda_ipc_plans_land_in_the_shims_device_buffers_in_turn()
    print("plan transfer checks passed on", torch.cuda.get_device_name(0))


def test_the_default_postprocess_batched_equals_it_called_per_request():
    """The omni set's default postprocess runs for all requests at once; a subclass that overrides
    postprocess (here: only calling the default) is called per request. Same states, same chunks,
    a step with no rows (all replayed) included."""
    from omni_sidecar.hook_api.hook_set import RequestInfo, StepBatch
    from omni_sidecar.hook_sets.omni.state_hooks import OmniStateHooks
    from proto.packed import StepLayout

    class PerRequest(OmniStateHooks):
        def postprocess(self, req_id, hidden_rows, state):
            return super().postprocess(req_id, hidden_rows, state)

    gen = torch.Generator().manual_seed(0)
    steps = [  # (req_ids, rows per request)
        (["a", "b", "c"], [3, 1, 2]),
        (["a", "b", "c"], [1, 1, 1]),
        ([], []),
        (["c", "a"], [1, 2]),
    ]
    runs = []
    for cls in (OmniStateHooks, PerRequest):
        hooks = cls(hidden_layers="0")
        hooks.on_new_requests([RequestInfo(r, 3, [1, 2, 3], None) for r in "abc"])
        runs.append(hooks)
    for step, (ids, rows) in enumerate(steps):
        qsl = [0]
        for n in rows:
            qsl.append(qsl[-1] + n)
        hidden = torch.randn(qsl[-1], 4, generator=gen)
        layer0 = torch.randn(qsl[-1], 4, generator=gen)
        for hooks in runs:
            batch = StepBatch(step, StepLayout(ids, qsl, [0] * len(ids), [3] * len(ids)))
            batch.hidden_layers = {0: layer0.clone()}
            hooks.process_model_output(batch, hidden.clone())
    batched, per_request = runs
    for r in "abc":
        assert_same_tree(batched.state.get(r), per_request.state.get(r))
        assert batched.state.nbytes(r) == per_request.state.nbytes(r)
        assert_same_tree(batched.output_chunks(r), per_request.output_chunks(r))
        assert_same_tree(batched.get_outputs(r), per_request.get_outputs(r))


def test_a_layout_naming_more_rows_than_the_hidden_states_fails_the_step_not_the_process():
    from omni_sidecar.hook_api.hook_set import HookErrors, RequestInfo, StepBatch
    from omni_sidecar.hook_sets.omni.state_hooks import OmniStateHooks
    from proto.packed import StepLayout

    hooks = OmniStateHooks()
    hooks.on_new_requests([RequestInfo("a", 3, [1, 2, 3], None)])
    batch = StepBatch(0, StepLayout(["a"], [0, 9], [0], [3]))
    with pytest.raises((ValueError, HookErrors), match="names 9 rows"):
        hooks.process_model_output(batch, torch.zeros(3, 4))


def test_bad_rows_and_stacks_from_the_sidecar_are_step_errors_before_anything_is_read():
    """Marks and stacks are a peer's: each is checked (index, row, ref, a row dimension) and a bad one
    is the step's SidecarError (or the ref's TensorRefError) before anything is read."""
    arena = ShmArena.create(4096, prefix="omni-test-plan")
    try:
        out = OutArena(arena)
        sent = _store({"rows": [torch.full((2,), float(i)) for i in range(ROWS)]}, out)
        stacks = out.stacks
        assert stacks[0].shape == [ROWS, 2]
        got = _copy_out_tree(arena, sent, torch.device("cpu"), stacks)["rows"]
        assert [r.tolist() for r in got] == [[float(i)] * 2 for i in range(ROWS)]
        cases = {
            "stack 1 of a message with 1": ({"x": row_mark(1, 0)}, stacks),
            f"row {ROWS} of stack 0": ({"x": row_mark(0, ROWS)}, stacks),
            "unknown extension": ({"x": msgspec.msgpack.Ext(9, b"\0")}, stacks),
            "outside": ({"x": row_mark(0, 0)}, [TensorRef(0, 4000, 400, [100], "float32")]),
            "no rows or bytes": ({"x": row_mark(0, 0)}, [TensorRef(0, 0, 4, [], "float32")]),
            # A zero-byte stack of a million (or 2**40) rows would be a view per row: refused unread.
            "no rows or bytes ": ({"x": row_mark(0, 0)}, [TensorRef(0, 0, 0, [10**6, 0], "float32")]),
            "no rows or bytes  ": ({"x": row_mark(0, 0)}, [TensorRef(0, 0, 0, [1 << 40, 0], "float32")]),
        }
        for message, (tree, plan_stacks) in cases.items():
            with pytest.raises((SidecarError, TensorRefError), match=message.strip()):
                _copy_out_tree(arena, encode_tree(tree), torch.device("cpu"), plan_stacks)
        # A stack with more rows than the marks name (the sidecar names each once): indexed row by
        # row, never a view per row of the whole stack; the rows named read right.
        got = _copy_out_tree(arena, encode_tree({"a": row_mark(0, 3), "b": row_mark(0, 1)}), torch.device("cpu"),
                             stacks)
        assert got["a"].tolist() == [3.0, 3.0] and got["b"].tolist() == [1.0, 1.0]
    finally:
        out.close()
