"""Plans built ahead (omni_sidecar/sessions/plan_ahead.py) are the plans the StepBegin would have got.

Two sessions with the omni set sending extra kwargs every step, one planning ahead and one not,
take the same steps; after every StepEnd the first builds the next steady decode step's plan (as
the server does once it answered the StepEnd). Every plan the shim would read (overlays, extra
kwargs with each request's state, errors) must be equal, step by step, through a steady decode
(used), a request finishing (the batch changes: planned afresh), an append between steps (the
state changes: dropped) and a prefill next to decodes (not predicted). Unit level; the e2e
equality through a real sidecar is tests/test_inproc_baseline.py (its sidecar plans ahead).
"""

from __future__ import annotations

import msgspec
import torch

from omni_arena.tensor_tree import TreeDecoder
from omni_arena.views import arena_tensor
from omni_sidecar.serve.metrics import SidecarMetrics
from omni_sidecar.hook_sets.omni.state_hooks import OmniStateHooks
from omni_sidecar.hook_sets.omni.wire import encode_additional_information
from omni_sidecar.sessions.plan_ahead import next_decode_layout
from omni_sidecar.sessions.session import Session
from omni_sidecar.sessions.store import FinishedOutputs
from proto.arena import ShmArena
from proto.messages import AppendPayload, Hello, NewRequest, StepBegin, StepEnd
from proto.packed import StepLayout, packed_layout, unpack_u32
from proto.tensors import TensorRef
from proto.version import PROTOCOL_MAJOR
from tests.support.trees import assert_same_tree


H = 4  # hidden size


def _session(plan_ahead: str) -> tuple[Session, ShmArena]:
    """A session with the omni set sending extra kwargs, and the shim's arena its StepEnds' hidden
    rows come in (so each step's postprocess changes every request's state)."""
    shim_arena = ShmArena.create(1 << 16, prefix="omni-test-ahead")
    hello = Hello(PROTOCOL_MAJOR, 0, "test", "none", "cpu", 0, 1, "m", H, "float32", 64, [shim_arena.info()])
    session = Session(1, hello, OmniStateHooks(extra_kwargs="1", plan_ahead=plan_ahead), FinishedOutputs(10),
                      SidecarMetrics())
    session.open_arenas()
    return session, shim_arena


def _hidden(arena: ShmArena, step: int, rows: int) -> TensorRef:
    """This step's hidden rows in the shim's arena: values that differ by step and row."""
    ref = TensorRef(0, 0, rows * H * 4, [rows, H], "float32")
    values = torch.arange(rows * H, dtype=torch.float32).view(rows, H) + 100 * step
    arena.view(ref)[:] = values.numpy().tobytes()
    return ref


def _decode(step: int, req_ids: list[str]) -> StepLayout:
    n = len(req_ids)
    return StepLayout(list(req_ids), list(range(n + 1)), [3 + step] * n, [3] * n)


def _payload(tag: str) -> bytes:
    return msgspec.msgpack.encode(encode_additional_information({"meta": {"tags": [tag]},
                                                                 "codes": {"c": torch.arange(3.0)}}))


def _read(session: Session, plan) -> tuple:
    """What the shim would read of the plan: its tensors out of the session's arena."""
    arena, stacks = session.arenas.out.arena, plan.stacks
    extra = TreeDecoder(len(stacks), lambda k: arena_tensor(arena, stacks[k]).clone()).decode(plan.extra_kwargs)
    return plan.step, [(o.row_start, o.rows) for o in plan.overlays], extra, sorted(plan.errors)


def test_plans_built_ahead_equal_plans_built_when_asked():
    (ahead, ahead_arena), (fresh, fresh_arena) = _session("1"), _session("0")
    try:
        _run_both(ahead, fresh, {id(ahead): ahead_arena, id(fresh): fresh_arena})
    finally:
        for session, arena in ((ahead, ahead_arena), (fresh, fresh_arena)):
            session.close()
            arena.close()


def _run_both(ahead: Session, fresh: Session, arenas: dict[int, ShmArena]) -> None:
    assert ahead.hooks.plans_ahead and not fresh.hooks.plans_ahead
    ids = ["a", "b", "c"]
    new = [NewRequest(r, 3, [1, 2, 3]) for r in ids]
    steps = [  # (StepBegin, StepEnd fields), what each session gets; "ahead": is a plan built after its StepEnd
        (StepBegin(0, packed_layout(ids, [0, 3, 6, 9], [0, 0, 0], [3, 3, 3]), new_requests=new), {}),  # prefill: no
        (StepBegin(1, _decode(0, ids).packed()), {}),  # built for step 2
        (StepBegin(2, _decode(1, ids).packed()), {}),  # used; built for step 3
        (StepBegin(3, _decode(2, ids).packed()), {"finished": ["b"]}),  # used; "b" ends with this step: none built
        (StepBegin(4, _decode(3, ["a", "c"]).packed()), {}),  # built for step 5
        (StepBegin(5, _decode(4, ["a", "c"]).packed()), {}),  # ... dropped by the append before it; built for step 6
        (StepBegin(6, _decode(5, ["a", "c"]).packed()), {}),  # used; built for step 7
        (StepBegin(7, packed_layout(["a", "c", "d"], [0, 1, 2, 5], [9, 9, 0], [3, 3, 3]),
                   new_requests=[NewRequest("d", 3, [4, 5, 6])]), {}),  # a new request: planned afresh
    ]
    for begin, end in steps:
        if begin.step == 5:  # between steps 4 and 5: the state changes after the plan was built
            for session in (ahead, fresh):
                session.appends.receive(AppendPayload("a", _payload("late")), lambda reply: None)
            assert ahead.ahead._plan is None and fresh.ahead is None
        plans = [s.step_begin(begin) for s in (ahead, fresh)]
        assert_same_tree(_read(ahead, plans[0]), _read(fresh, plans[1]))
        rows = unpack_u32(begin.batch.query_start_loc)[-1]
        for session in (ahead, fresh):
            hidden = _hidden(arenas[id(session)], begin.step, rows)
            session.step_end(StepEnd(begin.step, None, hidden=hidden, num_tokens=rows, **end))
            session.plan_ahead()  # what the server does once it answered the StepEnd
    status = ahead.status()
    assert (status.plans_ahead_built, status.plans_ahead_used) == (5, 3)  # see the comments above
    assert fresh.status().plans_ahead_built == 0
    state = ahead.hooks.state.get("a")
    assert state["meta"]["tags"] == ["late"]  # the append reached the state plans read
    # ... and so did every step's postprocess (read by each plan built after its StepEnd):
    assert state["meta"]["num_processed_tokens"] == 3 + 7 and state["hidden_states"]["last"][0, 0] == 700


def test_only_a_batch_of_single_decode_rows_is_predicted():
    assert next_decode_layout(_decode(0, ["a", "b"])) == StepLayout(["a", "b"], [0, 1, 2], [4, 4], [3, 3])
    assert next_decode_layout(StepLayout(["a", "b"], [0, 1, 3], [3, 3], [3, 3])) is None  # two rows
    assert next_decode_layout(StepLayout(["a"], [0, 1], [2], [3])) is None  # the last prefill row
    assert next_decode_layout(StepLayout(["a"], [0, 1], [5], [3], input_ids=[7])) is None  # ids unknown ahead
    assert next_decode_layout(StepLayout([], [0], [], [])) is None


def test_a_subclass_that_builds_its_own_kwargs_plans_ahead_only_when_it_says_so():
    class OwnKwargs(OmniStateHooks):
        def runtime_info(self, req_id, state):
            return {"n": 1}

    class Pure(OwnKwargs):
        plans_ahead = True

    assert not OwnKwargs(extra_kwargs="1").plans_ahead
    assert Pure(extra_kwargs="1").plans_ahead
    assert not Pure(extra_kwargs="1", plan_ahead="0").plans_ahead


def test_a_hand_over_drops_the_plan_built_ahead():
    """`export` (the hot-upgrade hand-over) drops a plan built ahead: the successor plans its own."""
    session, arena = _session("1")
    try:
        ids = ["a", "b"]
        begins = [StepBegin(0, _decode(0, ids).packed(), new_requests=[NewRequest(r, 3, [1, 2, 3]) for r in ids]),
                  StepBegin(1, _decode(1, ids).packed())]
        for begin in begins[:1]:
            session.step_begin(begin)
            session.step_end(StepEnd(begin.step, None, hidden=_hidden(arena, begin.step, 2), num_tokens=2))
            session.plan_ahead()
        assert session.status().plans_ahead_built == 1
        session.export()
        session.step_begin(begins[1])
        assert session.status().plans_ahead_used == 0  # planned afresh
    finally:
        session.close()
        arena.close()
