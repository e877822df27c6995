"""Forwards vLLM discarded under async scheduling: the shim names them (worker_shim/step/discards.py,
its shutdown path in worker_shim/step/finishes.py), the sidecar's session and hook sets withdraw
what those steps added, so a client's outputs equal those with async scheduling off
(docs/ARCHITECTURE.md, "Async scheduling"). Real engines: tests/test_e2e_async_scheduling.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from omni_sidecar.hook_api.hook_set import OmniHooks, RequestInfo
from omni_sidecar.hook_sets.omni.outputs import OutputLog
from omni_sidecar.hook_sets.reference import CaptureHiddenHooks
from proto.messages import Discarded, Hello, NewRequest, StepBegin, StepEnd
from proto.packed import packed_layout
from proto.version import PROTOCOL_MAJOR
from worker_shim.step.discards import DiscardWatch
from worker_shim.step.finishes import FinishWatch

# Each case: the batches of the steps in order (None: a step without a forward), then vLLM's finish
# notices (those the shim did not tell itself) at the step after the last; the forwards named
# discarded with async scheduling on. Off, none ever is: vLLM read each step's samples before it
# scheduled the next.
CASES = [
    # a sampled a stop token in step 1 (or its stop string completed, or it was aborted, once vLLM
    # read step 1): step 2, launched before that, ran it once more.
    ([["a", "b"], ["a", "b"], ["a", "b"]], {"a"}, [Discarded("a", 2)]),
    # Two finish in the same step; the notice names only requests the notice's step ran before.
    ([["a", "b", "c"], ["a", "b", "c"]], {"a", "c"}, [Discarded("a", 1), Discarded("c", 1)]),
    # Not scheduled in the step before its notice (a length finish: vLLM never schedules past
    # max_tokens; or the token budget left it out): its last forward was its own.
    ([["a", "b"], ["b"]], {"a"}, []),
    # The step before ran no forward (an empty schedule): nothing ran after the finish.
    ([["a"], None], {"a"}, []),
    # A notice of a request the steps never ran (aborted while waiting).
    ([["b"], ["b"]], {"x"}, []),
    ([], {"a"}, []),
]


@pytest.mark.parametrize("steps,finished,want", CASES)
@pytest.mark.parametrize("async_scheduling", [True, False])
def test_the_finish_notice_names_the_forward_launched_before_vllm_read_the_finish(
        steps, finished, want, async_scheduling):
    watch = DiscardWatch(async_scheduling)
    for step, req_ids in enumerate(steps):
        watch.note_step(step, req_ids)
    assert watch.discarded(finished) == (want if async_scheduling else [])


def test_a_step_that_raised_leaves_nothing_to_discard():
    watch = DiscardWatch(True)
    watch.note_step(4, ["a"])
    watch.note_step(5, None)  # upstream raised inside execute_model (abort_step)
    assert watch.discarded({"a"}) == []


def test_length_finishes_wait_a_step_for_vllms_notices_with_async_scheduling():
    watch = DiscardWatch(True)
    watch.note_step(8, ["a", "b", "c"])
    assert watch.hold(["a", "b"]) == []  # their last forward by max_tokens, step 8: told with step 9's notices
    watch.note_step(9, None)  # vLLM ran step 9 before it read step 8's samples
    # Step 9's notice names b: b ended in step 7 (a stop string at its second-to-last token), so its
    # finish is that notice's and its forward in step 8 was discarded; a finished by length.
    named = watch.take_held({"b", "x"})
    assert named == {"b"} and watch.release() == ["a"] and watch.release() == []
    off = DiscardWatch(False)
    assert off.hold(["a"]) == ["a"] and off.take_held({"a"}) == set() and off.release() == []


def _req(req_id, eos=2):
    return SimpleNamespace(req_id=req_id, sampling_params=SimpleNamespace(max_tokens=50, eos_token_id=eos,
                                                                          stop_token_ids=[]))


def _sampled(req_ids, tokens):
    return SimpleNamespace(req_ids=req_ids, sampled_token_ids=[[t] for t in tokens])


# At shutdown no next step brings the notice: the last two steps' samples tell. Each case: the step
# before the last's (req_ids, tokens), the last's; the requests that completed; with async scheduling
# the discarded forwards of the last step (2 is every request's eos).
SHUTDOWN = [
    # a stopped in step 6, ran once more in 7 (its sample there is vLLM's to discard).
    ((["a", "b"], [2, 5]), (["a", "b"], [9, 5]), {"a"}, [Discarded("a", 7)]),
    # a stopped in the last step: its own forward, nothing discarded.
    ((["a", "b"], [5, 5]), (["a", "b"], [2, 5]), {"a"}, []),
    # a stopped in step 6 and was not in step 7: complete, nothing discarded.
    ((["a", "b"], [2, 5]), (["b"], [5]), {"a"}, []),
    # nobody stopped: both were cut short.
    ((["a", "b"], [5, 5]), (["a", "b"], [5, 5]), set(), []),
]


@pytest.mark.parametrize("before,last,completed,discarded", SHUTDOWN)
def test_at_shutdown_the_last_two_steps_samples_tell_completed_and_discarded(before, last, completed, discarded):
    watch = FinishWatch()
    watch.note_new(_req("a"), 2)
    watch.note_new(_req("b"), 2)
    watch.note_sampled(6, _sampled(*before))
    watch.note_sampled(7, _sampled(*last))
    assert watch.stopped_by_token(async_scheduling=True) == (completed, discarded)
    # Off, only the last step counts (it had every request's latest sample) and nothing is discarded.
    last_stops = {r for r, t in zip(*last) if t == 2}
    assert watch.stopped_by_token(async_scheduling=False) == (last_stops, [])


def test_capture_withdraws_the_discarded_steps_rows_only():
    hooks = CaptureHiddenHooks()
    hooks.on_new_requests([RequestInfo("a", 2, [1, 2]), RequestInfo("b", 2, [3, 4])])
    for step in range(3):
        batch = SimpleNamespace(step=step, req_ids=["a", "b"], rows=lambda i: (i, i + 1))
        hooks.process_model_output(batch, torch.full((2, 4), float(step)))  # type: ignore[arg-type]
    hooks.on_discarded({"a": 1})  # not a's latest step: nothing withdrawn
    assert hooks.get_outputs("a")["hidden_states"].shape[0] == 3
    hooks.on_discarded({"a": 2})
    assert hooks.get_outputs("a")["hidden_states"][:, 0].tolist() == [0.0, 1.0]
    hooks.on_discarded({"a": 2})  # told twice: withdrawn once
    assert hooks.get_outputs("a")["hidden_states"].shape[0] == 2
    assert hooks.get_outputs("b")["hidden_states"][:, 0].tolist() == [0.0, 1.0, 2.0]


def _chunk(value):
    return {"x": torch.tensor([[float(value)]])}


def _xs(log, req_id):
    return [c["x"].item() for c in log.chunks(req_id)]


# Each case: what each step logs for a (a model result via `add`, then the step's postprocess via
# `add_step`), whether a client read the chunks before the withdrawal, the withdrawn step, and the
# chunks left.
LOG_CASES = [
    ({0: ["add", "step"], 1: ["add", "step"]}, False, 1, [0.0, 0.5]),
    ({0: ["add", "step"], 1: ["add", "step"]}, True, 1, [0.0, 0.5]),
    ({0: ["step"], 1: ["step"]}, True, 1, [0.5]),
    ({0: ["add"], 1: ["add"]}, False, 1, [0.0]),
    ({0: ["add", "step"], 1: ["add", "step"]}, False, 0, [0.0, 0.5, 1.0, 1.5]),  # not the latest step
    ({0: ["add"], 1: []}, False, 1, [0.0]),  # the step logged nothing for a
]


@pytest.mark.parametrize("logged,read_first,withdrawn,left", LOG_CASES)
def test_the_output_log_withdraws_a_requests_latest_step(logged, read_first, withdrawn, left):
    log = OutputLog()
    log.start("a")
    log.start("b")
    for step, kinds in logged.items():
        for kind in kinds:
            if kind == "add":
                log.add("a", _chunk(step), step)
                log.add("b", _chunk(step), step)
            else:
                log.add_step(["a", "b"], {"x": torch.tensor([[step + 0.5], [step + 0.5]])}, [0, 1, 2], {}, set(), step)
    if read_first:  # a streaming client cut the chunks already
        log.chunks("a")
    log.withdraw("a", withdrawn)
    assert _xs(log, "a") == left
    log.settle()
    assert len(log.chunks("b")) == sum(len(k) for k in logged.values())  # b untouched


class _Recording(OmniHooks):
    name = "recording"

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def on_discarded(self, steps):
        self.calls.append(("discarded", self.current_step, dict(steps)))

    def on_finished(self, req_ids):
        self.calls.append(("finished", self.current_step, sorted(req_ids)))


@pytest.mark.parametrize("message", [StepBegin, StepEnd])
def test_the_session_withdraws_before_the_finish_hands_the_outputs_out(message):
    from omni_sidecar.serve.metrics import SidecarMetrics
    from omni_sidecar.sessions.session import Session
    from omni_sidecar.sessions.store import FinishedOutputs

    hooks = _Recording()
    hello = Hello(PROTOCOL_MAJOR, 0, "test", "none", "cpu", 0, 1, "m", 4, "float32", 16, [])
    session = Session(1, hello, hooks, FinishedOutputs(10), SidecarMetrics())
    layout = packed_layout(["a", "b"], [0, 1, 2], [0, 0], [1, 1])
    session.step_end(StepEnd(0, layout, [NewRequest("a", 1, [1]), NewRequest("b", 1, [2])]))
    # "x" is not a request of this session (a successor that never saw it): not passed on.
    discarded = [Discarded("a", 1), Discarded("x", 1)]
    if message is StepBegin:
        session.step_begin(StepBegin(2, packed_layout(["b"], [0, 1], [1], [1]), finished=["a"], discarded=discarded))
        session.step_end(StepEnd(2))
    else:
        session.step_end(StepEnd(2, None, finished=["a"], discarded=discarded))
    assert hooks.calls == [("discarded", 2, {"a": 1}), ("finished", 2, ["a"])]
    session.close()


def test_streaming_reads_of_a_running_request_stop_before_its_latest_step_with_async_scheduling():
    from omni_sidecar.hook_sets.omni.state_hooks import OmniStateHooks

    hooks = OmniStateHooks()
    hooks.on_new_requests([RequestInfo("a", 1, [1])])
    for step in (0, 1):
        hooks.current_step = step
        hooks.log.add("a", _chunk(step), step)
        hooks.log.add_step(["a"], {"x": torch.tensor([[step + 0.5]])}, [0, 1], {}, set(), step)
    assert [c["x"].item() for c in hooks.output_chunks("a")] == [0.0, 0.5, 1.0, 1.5]  # off: all at once
    hooks.async_scheduling = True
    # Step 1 is the last the session handled: its entries wait for step 2's messages (a discard of
    # step 1 would come with them).
    assert [c["x"].item() for c in hooks.output_chunks("a")] == [0.0, 0.5]
    assert hooks.get_outputs("a")["x"].flatten().tolist() == [0.0, 0.5]
    hooks.current_step = 2
    assert [c["x"].item() for c in hooks.output_chunks("a")] == [0.0, 0.5, 1.0, 1.5]
    assert hooks.log.before_step("unknown", 2) == 0


def test_the_session_tells_the_hooks_whether_the_engine_schedules_asynchronously():
    from omni_sidecar.serve.metrics import SidecarMetrics
    from omni_sidecar.sessions.session import Session
    from omni_sidecar.sessions.store import FinishedOutputs

    for on in (True, False):
        hooks = _Recording()
        hello = Hello(PROTOCOL_MAJOR, 0, "test", "none", "cpu", 0, 1, "m", 4, "float32", 16, [], async_scheduling=on)
        session = Session(1, hello, hooks, FinishedOutputs(10), SidecarMetrics())
        assert hooks.async_scheduling is on
        session.close()
