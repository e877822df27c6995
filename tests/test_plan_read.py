"""The shim's plan read (worker_shim/step/plan_read.py): a plan's trees decoded with the shared
decoder straight off the wire, model states as host tensors of their own, and the landing
buffers whose views a steady step reuses (bounded whatever a peer sends)."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
import torch

from omni_sidecar.sessions.arenas import SessionArenas
from omni_sidecar.serve.metrics import SidecarMetrics
from proto.arena import ShmArena
from proto.codec import Codec
from proto.messages import Hello, StepPlan
from proto.plan_trees import row_mark
from proto.tensors import TensorRef
from proto.version import PROTOCOL_MAJOR
from tests.support.trees import assert_same_tree
from worker_shim.errors import SidecarError
from worker_shim.step import plan_read
from worker_shim.step.plan_read import read_plan, read_states

MODEL = torch.nn.Linear(1, 1)  # read_plan reads the model for its device: the host
ROWS = 8


def _wire(plan: StepPlan) -> StepPlan:
    """The plan as the shim gets it: encoded and decoded by the protocol's codec."""
    codec = Codec()
    return codec.decode(codec.encode(plan))


@pytest.fixture
def arenas():
    a = SessionArenas(1, Hello(PROTOCOL_MAJOR, 0, "test", "none", "cpu", 0, 1, "m", 4, "float32", 8, []),
                      SidecarMetrics())
    a.open(True, 0)
    yield a
    a.close()


def _plan(arenas: SessionArenas, step: int, kwargs: dict[str, Any]) -> StepPlan:
    arenas.out.reset()
    return _wire(StepPlan(step=step, extra_kwargs=arenas.encode_tree(kwargs), stacks=arenas.stacks))


def test_a_plans_kwargs_read_back_as_sent_and_are_copies_of_the_arena(arenas):
    want = {
        "runtime_additional_information": [{"meta": {"n": i}, "hidden_states": {"last": torch.full((1, 4), float(i))}}
                                           for i in range(ROWS)],
        "layers": {0: torch.arange(3.0), 7: torch.ones(2, dtype=torch.int32)},  # int keys below the top
        "temperature": torch.tensor(0.7),  # a 0-d tensor: a row of a 1-d stack
        "empty": torch.zeros(0, 4),
        "flag": True,
    }
    got = read_plan(arenas.out.arena, _plan(arenas, 0, want), None, MODEL, None)
    assert_same_tree(got, want)
    assert got["temperature"].shape == () and got["temperature"].item() == pytest.approx(0.7)
    arenas.out.arena.view(TensorRef(0, 0, 4096, [4096], "uint8"))[:] = b"\xff" * 4096
    assert_same_tree(got, want)  # copies out of the arena, not views of it


def test_model_states_are_host_tensors_of_their_own(arenas):
    arenas.out.reset()
    states = {f"r{i}": {"codes": torch.full((2,), i), "meta": {"i": i}} for i in range(ROWS)}
    plan = _wire(StepPlan(step=0, model_states=arenas.encode_tree(states), stacks=arenas.stacks))
    got = read_states(arenas.out.arena, plan)
    assert_same_tree(got, states)
    assert len({got[r]["codes"].untyped_storage().data_ptr() for r in got}) == ROWS  # each its own storage
    arenas.out.reset()
    not_dicts = _wire(StepPlan(step=0, model_states=arenas.encode_tree({"r0": [1, 2]}), stacks=arenas.stacks))
    with pytest.raises(SidecarError, match="not dicts"):
        read_states(arenas.out.arena, not_dicts)


def test_steady_plans_land_in_the_shims_buffers_and_a_steady_step_makes_no_view(arenas):
    """A plan's extra kwargs land in the landing's buffers, in turn: each step reads what a copy of
    its own reads; a step's tensors keep their values through the next step's read; once each
    buffer was used, a steady step makes no view: its tensors are those of two plans before,
    holding the new values."""
    landing = plan_read.PlanLanding()
    try:
        landed: list[tuple[list, list]] = []  # each step's tensors, and a copy of their values then
        for step in range(6):
            want = {"info": [{"last": torch.full((1, 4), float(step * 10 + i))} for i in range(ROWS)]}
            plan = _plan(arenas, step, want)
            got = read_plan(arenas.out.arena, plan, None, MODEL, None, landing)
            assert_same_tree(got, read_plan(arenas.out.arena, plan, None, MODEL, None))  # what a copy reads
            assert_same_tree(got, want)
            if landed:
                assert_same_tree(*landed[-1])  # the step before still holds its values
            lasts = [info["last"] for info in got["info"]]
            if step == 1:
                made = landing.views_made  # both buffers used once
            if step >= 2:
                assert landing.views_made == made
                assert all(a is b for a, b in zip(lasts, landed[-2][0]))
            landed.append((lasts, [t.clone() for t in lasts]))
        assert landing.landed == 6
    finally:
        landing.close()


def test_a_plan_that_outgrows_its_landing_buffer_gets_a_larger_one_and_views_of_it(arenas):
    landing = plan_read.PlanLanding()
    try:
        for step, rows in enumerate([ROWS, ROWS, 5 * ROWS, 5 * ROWS, ROWS, ROWS, ROWS, ROWS]):
            want = {"rows": [torch.full((3,), float(step * 100 + i)) for i in range(rows)], "whole": torch.zeros(0, 2)}
            plan = _plan(arenas, step, want)
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
            tree = {"r": row_mark(0, 0), "pad": "x" * (rows * 12)}
            got = read_plan(arena, StepPlan(step=step, extra_kwargs=msgspec.msgpack.encode(tree), stacks=stacks),
                            None, MODEL, None, landing)
            assert got["r"].shape == (1,)
            assert landing.rows_kept <= 1000
            assert landing.rows_kept == sum(len(v) for k, v in landing.views.items() if k[4])
        assert landing.views_made >= 2 * 12  # every step made its views: nothing stale was reused
        big = [TensorRef(0, 0, 2000, [2000, 1], "uint8")]
        tree = {"r": row_mark(0, 0), "pad": "x" * (2000 * 12)}
        read_plan(arena, StepPlan(step=99, extra_kwargs=msgspec.msgpack.encode(tree), stacks=big), None, MODEL, None,
                  landing)
        assert not any(k[4] and len(v) == 2000 for k, v in landing.views.items())
    finally:
        landing.close()
        arena.close()
