"""The step protocol: at each point of a step, which message goes to the sidecar and what the step waits for.

Pure: decided from the batch, the hook set's declared needs and what is pending (request notices,
failures, this step's results); no I/O. The request notices wait here (`Notices`) for the step
message that carries them. `SidecarLink` (worker_shim/step/link.py) sends what these say through
its port; `Recovery` handles a sidecar that is gone or handed the session over.

    step start      StepStart, always; it asks for an answer (a Pong) after a quiet spell, when the
                    sidecar may be handing the session over: that answer is taken at the step's one
                    wait (the plan's round trip, else a wait of its own before the forward)
    before forward  StepBegin, waiting for its StepPlan, when the needs say this batch needs one
    after forward   StepEnd (its StepResult taken later, never waited for here), or the fixed-size
                    StepTick when the step brings the sidecar nothing new, or nothing when the step
                    ran no forward and has nothing to tell
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, NamedTuple

import numpy as np

from proto.messages import Discarded, HookNeeds, NewRequest, Pong, StepBegin, StepEnd, StepPlan, StepStart, StepTick
from proto.settings import STEP_START_ANSWER_S


@dataclass(frozen=True)
class Exchange:
    """What one point of a step sends (None: nothing) and the reply it waits for (None: none)."""

    send: type | None = None
    wait: type | None = None


NOTHING = Exchange()
# The answers a steady step gets, made once (the protocol is asked several times a step).
START, START_ASKING = Exchange(StepStart), Exchange(StepStart, Pong)
PLAN, END, TICK = Exchange(StepBegin, StepPlan), Exchange(StepEnd), Exchange(StepTick)


def step_start(quiet_s: float, answer_after_s: float = STEP_START_ANSWER_S) -> Exchange:
    """A StepStart opens every step; after `quiet_s` without sending, as long as the sidecar may take
    to hand an idle session over (`answer_after_s`), it asks for an answer."""
    return START_ASKING if quiet_s >= answer_after_s else START


def before_forward(needs: HookNeeds, req_ids: list[str], prefilling: Callable[[], np.ndarray], payload_reqs: set[str],
                   live: set[str] | None = None, want_states: list[str] | None = None) -> Exchange:
    """A StepBegin when the batch (its request ids and per-row prefill flags, read only when the needs
    ask: hooks that never plan cost a steady step no array) needs the sidecar
    before its forward: requests whose state the model's mirror lacks (`want_states`), or the needs
    applied to the batch's rows. Scope "payload" counts the requests that carry a payload
    (`payload_reqs`), narrowed to those the current session knows (`live`; None: all of them)."""
    if want_states or _plan_needed(needs, req_ids, prefilling, payload_reqs, live):
        return PLAN
    return NOTHING


def _plan_needed(needs: HookNeeds, req_ids: list[str], prefilling: Callable[[], np.ndarray], payload_reqs: set[str],
                 live: set[str] | None) -> bool:
    mode = needs.pre_forward
    if mode == "never":
        return False
    if needs.pre_forward_scope == "all":
        return mode == "always" or bool(prefilling().any())
    if not payload_reqs:
        return False

    def counts(req_id: str) -> bool:
        return req_id in payload_reqs and (live is None or req_id in live)

    if mode == "always":
        return any(counts(r) for r in req_ids)
    flags = prefilling()
    return any(flags[i] and counts(r) for i, r in enumerate(req_ids))


class StepNews(NamedTuple):
    """What a step that ran (or skipped) its forward has for the sidecar (a tuple: made every step)."""

    forward: bool  # the step ran a forward (a batch); False: a finish-only step
    notices: bool  # new, finished or preempted requests not yet told
    failures: bool  # requests failed on the shim's side, not yet told
    hidden: bool  # hidden states of this step the sidecar takes (its needs and its slot allow)
    model_results: bool  # the model's own hooks left updates or outputs this step
    step_open: bool  # a StepStart went out for this step: the sidecar counts it as stepping


def after_forward(needs: HookNeeds, news: StepNews) -> Exchange:
    """The record that ends the step. A step announced with StepStart ends with a StepEnd, even an
    empty one; a step that brings nothing new, to hooks that read no per-step layout, ends with
    the StepTick; its StepResult is never waited for here."""
    if not news.forward and not (news.notices or news.failures or news.step_open):
        return NOTHING
    if (needs.step_layouts or news.notices or news.failures or (needs.hidden_states and news.hidden)
            or (needs.model_states and news.model_results)):
        return END
    return TICK


class Notices:
    """What the sidecar has yet to be told of vLLM's requests (new, finished, preempted, and the
    finished ones' discarded forwards), queued for the next step message that carries them. A step's
    taken notices are kept until the next step: the sidecar may hand the session over before it
    reads them (`requeue_step`)."""

    def __init__(self) -> None:
        self.new: list[NewRequest] = []
        self.finished: list[str] = []
        self.preempted: list[str] = []
        self.discarded: list[Discarded] = []
        self.taken_this_step: list[StepNotices] = []

    @property
    def pending(self) -> bool:
        return bool(self.new or self.finished or self.preempted or self.discarded)

    def take(self) -> StepNotices:
        notices = StepNotices(self.new, self.finished, self.preempted, self.discarded)
        self.new, self.finished, self.preempted, self.discarded = [], [], [], []
        if notices.new or notices.finished or notices.preempted or notices.discarded:
            self.taken_this_step.append(notices)
        return notices

    def step_started(self) -> None:
        self.taken_this_step.clear()

    def requeue_step(self) -> None:
        """This step's notices, taken for messages the sidecar never read: back in front of the
        queue, in their order, for the successor."""
        for taken in reversed(self.taken_this_step):
            self.new[:0], self.finished[:0] = taken.new, taken.finished
            self.preempted[:0], self.discarded[:0] = taken.preempted, taken.discarded
        self.taken_this_step.clear()


class StepNotices(NamedTuple):
    """The notices one step message carries."""

    new: list[NewRequest]
    finished: list[str]
    preempted: list[str]
    discarded: list[Discarded]


__all__ = ["Exchange", "NOTHING", "Notices", "StepNews", "StepNotices", "after_forward", "before_forward", "step_start"]
