"""A plan's trees as bytes whose tensors are msgpack extension values (protocol 1.8, issue #15):
the sidecar's session sends them to a shim of 1.8, the shim's decoder places every tensor without a
walk, and every mark a peer sends is checked (proto/plan_trees.py, worker_shim/step/plan_read.py)."""

from __future__ import annotations

import struct

import msgspec
import pytest
import torch

from omni_arena.tensor_tree import MIN_ROWS
from omni_sidecar.arenas import OutArena, SessionArenas
from omni_sidecar.metrics import SidecarMetrics
from proto.arena import ShmArena
from proto.codec import Codec
from proto.messages import Hello, StepPlan
from proto.plan_trees import STACK_ROW, STACK_WHOLE, decode_tree, encode_tree
from proto.tensors import TensorRef
from proto.version import EXT_TREES_MINOR
from tests.support.trees import assert_same_tree
from worker_shim.step import plan_read
from worker_shim.errors import SidecarError
from worker_shim.step.plan_read import read_plan, read_states

MODEL = torch.nn.Linear(1, 1)  # read_plan reads the model for its device: the host


def _hello(minor: int) -> Hello:
    return Hello(1, minor, "test", "none", "cpu", 0, 1, "m", 4, "float32", 8, [])


def _wire(plan: StepPlan) -> StepPlan:
    """The plan as the shim gets it: encoded and decoded by the protocol's codec."""
    codec = Codec()
    return codec.decode(codec.encode(plan))


def _kwargs() -> dict:
    return {
        "runtime_additional_information": [
            {"meta": {"prompt_len": 8, "n": i}, "hidden_states": {"last": torch.full((1, 4), float(i))}}
            for i in range(MIN_ROWS + 3)
        ],
        "layers": {0: torch.arange(3.0), 7: torch.ones(2, dtype=torch.int32)},  # int keys below the top
        "few": [torch.full((2,), 5.0) for _ in range(MIN_ROWS - 1)],  # 1.7 sends fewer than MIN_ROWS alone
        "empty": torch.zeros(0, 4),
        "spans": [[0, 1], [1, 2]],
        "flag": True,
    }


@pytest.fixture
def arenas():
    a = SessionArenas(1, _hello(EXT_TREES_MINOR), SidecarMetrics())
    a.open(True, 0)
    yield a
    a.close()


def test_a_plan_for_a_shim_of_18_carries_its_trees_as_bytes_and_reads_back_without_a_walk(arenas, monkeypatch):
    want = _kwargs()
    arenas.out.reset()
    sent = arenas.encode_tensors(want)
    assert type(sent) is bytes
    # A stack per kind, in the order the tree meets them (a kind met once: a stack of one row); the
    # empty tensor, which no stack can hold, a stack used whole; the tree names them all.
    assert [s.shape for s in arenas.stacks] == [[MIN_ROWS + 3, 1, 4], [1, 3], [1, 2], [MIN_ROWS - 1, 2], [0, 4]]
    marks = decode_tree(sent)
    assert [d["hidden_states"]["last"] for d in marks["runtime_additional_information"]] == [
        (0, i) for i in range(MIN_ROWS + 3)]
    plan = _wire(StepPlan(step=3, extra_kwargs=sent, stacks=arenas.stacks))
    assert plan.extra_kwargs == sent

    def walked(*args, **kwargs):
        raise AssertionError("a 1.8 plan's tree was walked in Python")

    monkeypatch.setattr(plan_read, "index_trees", walked)
    got = read_plan(arenas.out.arena, plan, None, MODEL, None)
    assert_same_tree(got, want)
    arenas.out.arena.view(TensorRef(0, 0, 4096, [4096], "uint8"))[:] = b"\xff" * 4096
    assert_same_tree(got, want)  # copies out of the arena, not views of it


def test_model_states_for_a_shim_of_18_are_host_tensors_of_their_own(arenas):
    arenas.out.reset()
    states = {f"r{i}": {"codes": torch.full((2,), i), "meta": {"i": i}} for i in range(MIN_ROWS)}
    sent = arenas.encode_tensors(states)
    plan = _wire(StepPlan(step=0, model_states=sent, stacks=arenas.stacks))
    got = read_states(arenas.out.arena, plan)
    assert_same_tree(got, states)
    assert len({got[r]["codes"].untyped_storage().data_ptr() for r in got}) == MIN_ROWS  # each its own storage
    not_dicts = arenas.encode_tensors({"r0": [1, 2]})
    with pytest.raises(SidecarError, match="not dicts"):
        read_states(arenas.out.arena, _wire(StepPlan(step=0, model_states=not_dicts, stacks=arenas.stacks)))


@pytest.mark.parametrize("minor", [7, 8])
def test_the_session_sends_bytes_only_to_a_shim_that_reads_them(minor):
    a = SessionArenas(1, _hello(minor), SidecarMetrics())
    a.open(True, 0)
    try:
        a.out.reset()
        sent = a.encode_tensors(_kwargs())
        assert (type(sent) is bytes) == (minor >= EXT_TREES_MINOR)
    finally:
        a.close()


def _ext(code: int, data: bytes) -> msgspec.msgpack.Ext:
    return msgspec.msgpack.Ext(code, data)


def test_every_mark_a_sidecar_sends_is_checked_and_a_bad_one_is_the_steps_error():
    arena = ShmArena.create(4096, prefix="omni-test-trees")
    try:
        out = OutArena(arena)
        rows = out.put_stack([torch.full((2,), float(i)) for i in range(MIN_ROWS)])
        whole = out.put_whole(torch.arange(3.0))
        stacks = out.stacks
        row = struct.Struct("<II").pack

        def plan(tree, plan_stacks=stacks, raw=None):
            return _wire(StepPlan(step=0, extra_kwargs=raw if raw is not None else msgspec.msgpack.encode(tree),
                                  stacks=plan_stacks))

        good = read_plan(arena, plan({"r": _ext(STACK_ROW, row(rows, 2)), "w": _ext(STACK_WHOLE, struct.pack("<I", whole))}),
                         None, MODEL, None)
        assert good["r"].tolist() == [2.0, 2.0] and good["w"].tolist() == [0.0, 1.0, 2.0]
        cases = {
            "unknown extension value": plan({"x": _ext(9, b"\0" * 8)}),
            "unknown extension value ": plan({"x": _ext(STACK_ROW, b"\0" * 4)}),  # a row mark of the wrong length
            "stack 5 of a plan with 2": plan({"x": _ext(STACK_ROW, row(5, 0))}),
            "stack 7 of a plan with 2": plan({"x": _ext(STACK_WHOLE, struct.pack("<I", 7))}),
            f"row {MIN_ROWS} of stack 0": plan({"x": _ext(STACK_ROW, row(0, MIN_ROWS))}),
            "no rows or bytes": plan({"x": _ext(STACK_ROW, row(0, 0))}, [TensorRef(0, 0, 4, [], "float32")]),
            "no rows or bytes ": plan({"x": _ext(STACK_ROW, row(0, 0))}, [TensorRef(0, 0, 0, [1 << 40, 0], "float32")]),
            "malformed tree": plan(None, raw=b"\xc1"),  # not msgpack
            "malformed tree ": plan({1: 2}),  # keyword arguments are named by strings
            "outside": plan({"x": _ext(STACK_ROW, row(0, 0))}, [TensorRef(0, 4000, 400, [100], "float32")]),
            "no arena": None,
        }
        for message, bad in cases.items():
            with pytest.raises(Exception, match=message.strip()) as info:
                if bad is None:
                    read_plan(None, plan({"x": _ext(STACK_ROW, row(0, 0))}), None, MODEL, None)
                else:
                    read_plan(arena, bad, None, MODEL, None)
            assert "\n" not in str(info.value)
            assert info.type.__name__ in ("SidecarError", "TensorRefError")
        # A stack with more rows than the tree has room to name: indexed row by row (no view per row
        # of a stack a hostile peer made huge); the rows named read right.
        big = TensorRef(0, stacks[rows].offset, stacks[rows].nbytes, stacks[rows].shape, "float32")
        got = read_plan(arena, plan({"a": _ext(STACK_ROW, row(0, 3))}, [big]), None, MODEL, None)
        assert got["a"].tolist() == [3.0, 3.0]
        assert type(plan_read.StackReader(arena, [big], torch.device("cpu"), False)._rows_of(0)) is torch.Tensor
    finally:
        out.close()


def test_a_tree_the_sender_cannot_encode_fails_where_it_is_built(arenas):
    """A hook's value msgpack cannot carry fails the plan's encode in the sidecar (the requests'
    error), never a frame the shim would have to refuse."""
    with pytest.raises(TypeError, match="cannot hold a object"):
        encode_tree({"x": object()})
    arenas.out.reset()
    with pytest.raises(TypeError, match="cannot hold a object"):
        arenas.encode_tensors({"x": [torch.zeros(2), object()]})
    assert arenas.stacks == []  # nothing of it went into the arena
    with pytest.raises(TypeError, match="9 dimensions"):  # a stack of it could not be sent either
        arenas.encode_tensors({"x": torch.zeros([1] * 9)})


def test_two_trees_of_one_plan_name_their_own_stacks(arenas):
    """Model states and extra kwargs go into one plan's stacks: the second tree's marks start after
    the first's stacks, and each reads back as it was sent."""
    arenas.out.reset()
    states = {f"r{i}": {"codes": torch.full((3,), i), "meta": {"i": i}} for i in range(4)}
    sent_states = arenas.encode_tensors(states)
    kwargs = {"info": [{"last": torch.full((1, 2), -float(i))} for i in range(5)], "codes": torch.arange(3)}
    sent_kwargs = arenas.encode_tensors(kwargs)
    assert [s.shape for s in arenas.stacks] == [[4, 3], [5, 1, 2], [1, 3]]
    assert decode_tree(sent_kwargs)["codes"] == (2, 0)  # its own kind's stack, after the states' one
    plan = _wire(StepPlan(step=0, extra_kwargs=sent_kwargs, model_states=sent_states, stacks=arenas.stacks))
    assert_same_tree(read_states(arenas.out.arena, plan), states)
    assert_same_tree(read_plan(arenas.out.arena, plan, None, MODEL, None), kwargs)


def test_aliased_stacks_cannot_multiply_the_rows_a_small_tree_makes():
    """Stacks may overlap in the arena: a hostile plan naming row 0 of many stacks that alias the
    same large bytes must not make a view per row of each (one budget of rows for the whole tree,
    from its size); and copies a tree asks for (model states) are bounded by the stacks' bytes."""
    arena = ShmArena.create(1 << 16, prefix="omni-test-trees")
    try:
        rows = 4096
        alias = [TensorRef(0, 0, rows * 4, [rows, 4], "uint8") for _ in range(16)]
        tree = {f"s{k}": _ext(STACK_ROW, struct.pack("<II", k, 0)) for k in range(16)}
        tree["pad"] = "x" * (rows * 12)  # room, by size, to name every row of one stack, not of 16
        reader = plan_read.StackReader(arena, alias, torch.device("cpu"), own=False)
        got = reader.decode(msgspec.msgpack.encode(tree), dict)
        assert sum(type(r) is tuple for r in reader.rows.values()) == 1  # one unbound, the rest indexed
        assert all(got[f"s{k}"].shape == (4,) for k in range(16))
        small = [TensorRef(0, 0, 8 * 4 * 4, [8, 4], "float32")]
        twice = {"a": _ext(STACK_WHOLE, struct.pack("<I", 0)), "b": _ext(STACK_WHOLE, struct.pack("<I", 0))}
        with pytest.raises(SidecarError, match="more bytes than"):
            plan_read.StackReader(arena, small, torch.device("cpu"), own=True).decode(
                msgspec.msgpack.encode({"r": twice}), dict)
        once = plan_read.StackReader(arena, small, torch.device("cpu"), own=True).decode(
            msgspec.msgpack.encode({"r": {"a": twice["a"]}}), dict)
        assert once["r"]["a"].shape == (8, 4)
    finally:
        arena.close()


def test_a_zero_dim_tensor_in_a_18_plan_is_a_row_and_the_session_counts_the_rows_it_stacks():
    """vLLM-omni kwargs may hold scalars as 0-d tensors (a temperature): for a shim of 1.8 such a
    tensor is a row of a stack of 0-d tensors (a 1-d stack); the session counts the rows it stacks."""
    from bench.omni_step import PHASES, Run
    from omni_sidecar.omni.hooks import OmniStateHooks
    from proto.messages import BatchLayout, StepBegin

    class WithTemperature(OmniStateHooks):
        def build_extra_kwargs(self, batch):
            return {**super().build_extra_kwargs(batch), "temperature": torch.tensor(0.7)}

    n = MIN_ROWS
    run = Run(EXT_TREES_MINOR, WithTemperature, n, 4, [0])
    try:
        run.start_batch()
        for _ in range(3):
            run.decode_step({p: [] for p in PHASES})
        s, step = run.session, run.step + 1
        before = s.status().stacked_rows
        plan = s.step_begin(StepBegin(step, BatchLayout(run.req_ids, list(range(n + 1)), [11] * n, [8] * n)))
        assert s.status().stacked_rows - before == n + 1  # the hidden rows, and the temperature's
        got = read_plan(s.arenas.out.arena, _wire(plan), None, MODEL, None)
        assert got["temperature"].shape == () and got["temperature"].item() == pytest.approx(0.7)
        assert len(got["runtime_additional_information"]) == n
    finally:
        run.close()


def test_steady_plans_land_in_the_shims_buffers_and_a_steady_step_makes_no_view():
    """A 1.8 plan's extra kwargs land in the connection's buffers (worker_shim/step/plan_read.py,
    PlanLanding): each step reads what a copy of its own reads; a step's tensors keep their values
    through the next step's read; once each buffer was used, a steady decode step makes no view:
    its tensors are those of two plans before, holding the new values."""
    from bench.omni_step import PROMPT, Run
    from omni_sidecar.omni.hooks import OmniStateHooks
    from proto.messages import BatchLayout, StepBegin, StepEnd

    n, hidden = MIN_ROWS + 2, 4
    run = Run(EXT_TREES_MINOR, OmniStateHooks, n, hidden, [])
    landing = plan_read.PlanLanding()
    try:
        run.start_batch()
        s, arena = run.session, run.session.arenas.out.arena
        landed: list[tuple[list, list]] = []  # each step's tensors, and a copy of their values then
        source = None  # the landing's view of the arena's span, as the step before left it
        for k in range(6):
            run.step += 1
            plan = _wire(s.step_begin(StepBegin(run.step, BatchLayout(
                run.req_ids, list(range(n + 1)), [PROMPT + k] * n, [PROMPT] * n))))
            got = read_plan(arena, plan, None, MODEL, None, landing)
            assert_same_tree(got, read_plan(arena, plan, None, MODEL, None))  # what a copy of its own reads
            if landed:
                assert_same_tree(*landed[-1])  # the step before still holds its values
            lasts = [info["hidden_states"]["last"] for info in got["runtime_additional_information"]]
            if k == 1:
                made = landing.views_made  # both buffers used once
            if k >= 2:
                assert landing.views_made == made
                assert all(a is b for a, b in zip(lasts, landed[-2][0]))
                assert landing._source[3] is source  # the same span of the same arena: its view kept
            source = landing._source[3]
            landed.append((lasts, [t.clone() for t in lasts]))
            # This step's hidden rows: new values each step, so the next plan's rows differ.
            run.shim_arena.view(run.rows)[:] = torch.full((n, hidden), float(k)).numpy().tobytes()
            s.step_end(StepEnd(run.step, None, hidden=run.rows, num_tokens=n))
            if s.ahead is not None:
                s.ahead.build()
            s.hooks.between_steps()
        assert landing.landed == 6
        assert float(landed[-1][0][0][0, 0]) == 4.0  # step 5 reads what step 4's rows left
    finally:
        landing.close()
        run.close()


def test_a_plan_that_outgrows_its_landing_buffer_gets_a_larger_one_and_views_of_it(arenas):
    landing = plan_read.PlanLanding()
    try:
        for step, rows in enumerate([MIN_ROWS, MIN_ROWS, 5 * MIN_ROWS, 5 * MIN_ROWS, MIN_ROWS, MIN_ROWS, MIN_ROWS, MIN_ROWS]):
            want = {"rows": [torch.full((3,), float(step * 100 + i)) for i in range(rows)], "whole": torch.zeros(0, 2)}
            arenas.out.reset()
            plan = _wire(StepPlan(step=step, extra_kwargs=arenas.encode_tensors(want), stacks=arenas.stacks))
            made = landing.views_made
            assert_same_tree(read_plan(arenas.out.arena, plan, None, MODEL, None, landing), want)
            # A buffer's first plan, a plan that outgrew it (its views go with it) and the first plan of
            # a shape in the larger one make views; a plan placed as the one two before, none.
            assert (landing.views_made > made) == (step < 6)
    finally:
        landing.close()


def test_a_sidecar_that_moves_its_stacks_every_step_cannot_grow_the_views_kept(monkeypatch):
    """Each plan names one row of a stack of many rows at a new shape: each step's rows are made (the
    tree's size pays for them) but the views kept stay within ROWS_KEPT, and a stack of more rows
    than that alone is never kept."""
    monkeypatch.setattr(plan_read, "ROWS_KEPT", 1000)
    arena = ShmArena.create(1 << 16, prefix="omni-test-trees")
    landing = plan_read.PlanLanding()
    try:
        for step in range(12):
            rows = 300 + step  # a new shape each step: a new key
            stacks = [TensorRef(0, 0, rows, [rows, 1], "uint8")]
            tree = {"r": _ext(STACK_ROW, struct.pack("<II", 0, 0)), "pad": "x" * (rows * 12)}
            got = read_plan(arena, StepPlan(step=step, extra_kwargs=msgspec.msgpack.encode(tree), stacks=stacks),
                            None, MODEL, None, landing)
            assert got["r"].shape == (1,)
            assert landing.rows_kept <= 1000
            assert landing.rows_kept == sum(len(v) for k, v in landing.views.items() if k[4])
        assert landing.views_made >= 2 * 12  # every step made its views: nothing stale was reused
        big = [TensorRef(0, 0, 2000, [2000, 1], "uint8")]
        tree = {"r": _ext(STACK_ROW, struct.pack("<II", 0, 0)), "pad": "x" * (2000 * 12)}
        read_plan(arena, StepPlan(step=99, extra_kwargs=msgspec.msgpack.encode(tree), stacks=big), None, MODEL, None,
                  landing)
        assert not any(k[4] and len(v) == 2000 for k, v in landing.views.items())
    finally:
        landing.close()
        arena.close()
