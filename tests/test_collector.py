"""Python's cycle collector in the sidecar runs between steps, never inside one (omni_sidecar/serve/collector.py)."""

from __future__ import annotations

import gc
import weakref

import pytest

from omni_sidecar.serve.collector import FULL_DEFERRED, OVERDUE, PACEABLE, CollectorPacer

pytestmark = pytest.mark.skipif(not PACEABLE, reason="Python 3.14's incremental collector is left to itself")


class _Cycle:
    def __init__(self) -> None:
        self.me = self


def _garbage(n: int) -> weakref.ref:
    """`n` cycles only the collector frees; a weak reference to one of them."""
    first = _Cycle()
    ref = weakref.ref(first)
    del first
    for _ in range(n):
        _Cycle()
    return ref


@pytest.fixture
def pacer():
    was_enabled = gc.isenabled()
    pacer = CollectorPacer(paced=True)
    pacer.start()
    yield pacer
    pacer.stop()
    assert gc.isenabled() == was_enabled and gc.get_freeze_count() == 0


def _ready() -> bool:
    return True


def test_a_paced_collector_runs_only_where_it_is_called(pacer):
    assert not gc.isenabled() and gc.get_freeze_count() > 0  # start-up's objects frozen out of the walks
    threshold = gc.get_threshold()[0]
    gc.collect()  # anyone's gc.collect() (a hook's) counts as elsewhere
    assert pacer.counts["elsewhere"] == 1
    left = _garbage(3 * threshold)
    assert left() is not None  # past the threshold, and nothing ran by itself
    pacer.collect_if_overdue()
    assert left() is not None  # not yet overdue
    pacer.collect_due(lambda: False)
    assert left() is not None  # a shim waits on us: not now
    pacer.collect_due(_ready)
    assert left() is None
    assert pacer.counts == {"between_steps": 1, "idle": 0, "overdue": 0, "elsewhere": 1} and pacer.pause_us_max > 0
    overdue = _garbage(OVERDUE * threshold + threshold)
    pacer.collect_if_overdue()  # no step offered a place: the loop collects
    assert overdue() is None and pacer.counts["overdue"] == 1


def test_an_unpaced_collector_is_the_interpreters_and_is_counted():
    was_enabled = gc.isenabled()
    pacer = CollectorPacer(paced=False)
    pacer.start()
    try:
        gc.enable()
        pacer.collect_due(_ready)  # does nothing: the interpreter collects
        _garbage(3 * gc.get_threshold()[0])
        assert pacer.counts["elsewhere"] >= 1 and pacer.counts["between_steps"] == 0
    finally:
        pacer.stop()
        if not was_enabled:
            gc.disable()


def test_a_full_collection_waits_for_an_idle_loop_unless_far_overdue(pacer):
    """Between steps the young generations are collected as due; a full collection (every live
    request's state and outputs) waits for the loop to idle, or until FULL_DEFERRED times overdue."""
    t0, _, t2 = gc.get_threshold()
    full = lambda: gc.get_stats()[2]["collections"]  # noqa: E731
    before = full()
    while gc.get_count()[2] <= t2:  # enough middle collections to make a full one due
        _garbage(t0 + 1)
        pacer.collect_due(_ready)
    _garbage(t0 + 1)
    pacer.collect_due(_ready)
    assert full() == before  # due, put off
    pacer.collect_idle()
    assert full() == before + 1 and gc.get_count()[2] == 0 and pacer.counts["idle"] == 1
    while gc.get_count()[2] <= FULL_DEFERRED * t2:  # a loop that never idles
        _garbage(t0 + 1)
        pacer.collect_due(_ready)
    _garbage(t0 + 1)
    pacer.collect_due(_ready)
    assert full() == before + 2


@pytest.mark.parametrize("paced", [True, False])
def test_a_sidecar_stepping_a_shim_collects_only_between_its_steps(tmp_path, paced):
    """A real sidecar process serving the omni set's steps (a plan and hidden rows every step, some
    time between them as an engine samples) through the shim's real link: with pacing (the default)
    the collections ran between steps, none where the loop stood nor by the interpreter; without
    (`--no-gc-between-steps`), the interpreter's ran wherever they fell."""
    from bench.step_cost import ShimUnderTest
    from omni_sidecar.client import SidecarClient

    shim = None
    try:
        shim = ShimUnderTest(tmp_path, "omni" if paced else "omni-gc-anywhere", "omni", 16)
        shim.run(400, 0.0002, True, 0.0005)
        with SidecarClient(shim.link.conn.endpoint) as client:
            status = client.status()
    finally:
        if shim is not None:
            shim.close()
    stepping = tuple(status.collections[where] for where in ("between_steps", "overdue", "elsewhere"))
    if paced:
        assert stepping[0] >= 1 and stepping[1:] == (0, 0), stepping
    else:
        assert stepping[0] == 0 and stepping[2] >= 1, stepping
