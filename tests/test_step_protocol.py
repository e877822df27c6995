"""The step protocol (worker_shim/step/protocol.py) as tables: at each point of a step, from the
batch, the hook set's needs and what is pending, which message goes and what the step waits for."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from proto.messages import Discarded, HookNeeds, NewRequest, Pong, StepBegin, StepEnd, StepPlan, StepStart, StepTick
from proto.settings import STEP_START_ANSWER_S
from worker_shim.step.batch import PayloadTracker
from worker_shim.step.protocol import Exchange, Notices, StepNews, after_forward, before_forward, step_start


def batch(req_ids: list[str], computed: list[int], prompt: int = 4) -> SimpleNamespace:
    """vLLM's InputBatch as the protocol reads it: ids and prefill flags (rows before the prompt's end)."""
    n = len(req_ids)
    return SimpleNamespace(req_ids=req_ids, num_computed_tokens_np=np.array(computed, dtype=np.int32),
                           prefill_len_np=np.full(n, prompt, dtype=np.int32),
                           is_prefilling_np=np.array(computed, dtype=np.int32) < prompt)


@pytest.mark.parametrize("quiet_s, want", [
    (0.0, Exchange(StepStart)),
    (STEP_START_ANSWER_S / 2, Exchange(StepStart)),
    (STEP_START_ANSWER_S, Exchange(StepStart, Pong)),  # quiet long enough for an idle hand-over
    (60.0, Exchange(StepStart, Pong)),
])
def test_every_step_starts_with_a_step_start_that_asks_an_answer_only_after_a_quiet_spell(quiet_s, want):
    assert step_start(quiet_s) == want


PLAN = Exchange(StepBegin, StepPlan)
NONE = Exchange()
PREFILL = batch(["carrier", "plain"], [0, 0])
DECODE = batch(["carrier", "plain"], [4, 4])
PLAIN_PREFILL = batch(["plain"], [0])


@pytest.mark.parametrize("needs, step_batch, live, want_states, want", [
    # pass-through hooks: never a plan
    (HookNeeds(), PREFILL, {"carrier", "plain"}, [], NONE),
    # a plan for prefill rows of requests that carry a payload (the overlay hooks' needs)
    (HookNeeds(pre_forward="prefill", pre_forward_scope="payload"), PREFILL, {"carrier", "plain"}, [], PLAN),
    (HookNeeds(pre_forward="prefill", pre_forward_scope="payload"), DECODE, {"carrier", "plain"}, [], NONE),
    (HookNeeds(pre_forward="prefill", pre_forward_scope="payload"), PLAIN_PREFILL, {"plain"}, [], NONE),
    # a payload request the current session does not know (admitted before a loss): not asked for
    (HookNeeds(pre_forward="prefill", pre_forward_scope="payload"), PREFILL, {"plain"}, [], NONE),
    # every step with a payload request in it
    (HookNeeds(pre_forward="always", pre_forward_scope="payload"), DECODE, {"carrier", "plain"}, [], PLAN),
    (HookNeeds(pre_forward="always", pre_forward_scope="payload"), PLAIN_PREFILL, {"plain"}, [], NONE),
    # scope all: any prefill row, any step
    (HookNeeds(pre_forward="prefill"), PLAIN_PREFILL, {"plain"}, [], PLAN),
    (HookNeeds(pre_forward="prefill"), DECODE, {"carrier", "plain"}, [], NONE),
    (HookNeeds(pre_forward="always"), DECODE, {"carrier", "plain"}, [], PLAN),
    # the model's mirror lacks a request's state: asked for in a StepBegin whatever the needs
    (HookNeeds(), DECODE, {"carrier", "plain"}, ["plain"], PLAN),
])
def test_a_step_begin_goes_before_the_forward_only_when_the_batch_needs_a_plan(needs, step_batch, live, want_states,
                                                                             want):
    payloads = PayloadTracker()
    payloads.note_new("carrier", {"x": 1})
    payloads.note_new("plain", None)
    assert before_forward(needs, step_batch.req_ids, lambda: step_batch.is_prefilling_np, payloads.payload_reqs, live,
                          want_states) == want


def news(forward=True, notices=False, failures=False, hidden=False, model_results=False, step_open=True) -> StepNews:
    return StepNews(forward, notices, failures, hidden, model_results, step_open)


END, TICK = Exchange(StepEnd), Exchange(StepTick)
LAYOUTS = HookNeeds(step_layouts=True)  # hooks that read every step's layout
QUIET = HookNeeds(step_layouts=False)  # pass-through hooks
HIDDEN = HookNeeds(hidden_states=True, step_layouts=False)
MODEL = HookNeeds(model_states=True, step_layouts=False)


@pytest.mark.parametrize("needs, step_news, want", [
    # a steady step to hooks that read nothing per step: the fixed-size StepTick
    (QUIET, news(), TICK),
    # anything new makes it a StepEnd
    (QUIET, news(notices=True), END),
    (QUIET, news(failures=True), END),
    (LAYOUTS, news(), END),
    (HIDDEN, news(hidden=True), END),
    (HIDDEN, news(hidden=False), TICK),  # the sidecar wants them but this step has none
    (QUIET, news(hidden=True), TICK),  # hidden states the hooks did not ask for
    (MODEL, news(model_results=True), END),
    (QUIET, news(model_results=True), TICK),  # model results the hooks do not take
    # a step without a forward: a StepEnd when it announced itself or has something to tell
    (QUIET, news(forward=False), TICK),
    (LAYOUTS, news(forward=False), END),
    (QUIET, news(forward=False, step_open=False), NONE),
    (LAYOUTS, news(forward=False, step_open=False), NONE),
    (QUIET, news(forward=False, step_open=False, notices=True), END),
    (QUIET, news(forward=False, step_open=False, failures=True), END),
])
def test_the_step_ends_with_a_step_end_a_step_tick_or_nothing(needs, step_news, want):
    assert after_forward(needs, step_news) == want


def test_notices_ride_the_next_step_message_and_a_step_handed_over_unread_gets_them_back_in_order():
    notices = Notices()
    assert not notices.pending and notices.take() == ([], [], [], [])
    first, second = NewRequest("a", 1, [1]), NewRequest("b", 1, [2])
    notices.new.append(first)
    notices.finished.append("old")
    notices.discarded.append(Discarded("old", 3))
    assert notices.pending
    assert notices.take() == ([first], ["old"], [], [Discarded("old", 3)])  # the StepBegin's
    notices.new.append(second)
    notices.preempted.append("p")
    assert notices.take() == ([second], [], ["p"], [])  # the StepEnd's
    assert not notices.pending
    notices.finished.append("later")  # queued after the step's messages went
    notices.discarded.append(Discarded("later", 3))
    notices.requeue_step()  # the sidecar handed the session over before it read them
    assert (notices.new, notices.finished, notices.preempted) == ([first, second], ["old", "later"], ["p"])
    assert notices.discarded == [Discarded("old", 3), Discarded("later", 3)]
    notices.take()
    notices.step_started()  # a new step: the last one's notices were read, nothing to give back
    notices.requeue_step()
    assert not notices.pending
