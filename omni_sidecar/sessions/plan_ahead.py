"""The next step's plan, built while the shim samples and schedules.

After a StepEnd the shim samples, vLLM schedules the next step and prepares its inputs; only
then does the StepBegin come, and the shim waits for its plan: with hooks that work every step
(the omni set's extra kwargs) the plan's hook work was most of a step's wait. In a steady decode
the next batch is known once a step has ended: the same requests in the same rows, one decode
row each, each one token further. With hooks whose plans are pure functions of the batch and the
requests' state (`OmniHooks.plans_ahead`), the sidecar builds that batch's plan as soon as it
has answered the StepEnd; the StepBegin that brings exactly that batch and nothing else (no
request change, no states asked) is answered with it at once. Anything that touches the hooks'
state in between (a request change, an append, a hand-over) drops the plan; a StepBegin with
any other batch is planned afresh, as before. The plan's tensors sit in the sidecar's arena,
which the shim copied out of before it sent the StepEnd (the arena's reuse rule, unchanged).
See docs/ARCHITECTURE.md, "Plans ahead".
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

from omni_sidecar.hook_api.hook_set import StepBatch
from proto.messages import Overlay, StepBegin
from proto.packed import StepLayout
from proto.tensors import TensorRef

# The session's plan builder: (batch, errors to fill) -> (overlays, extra kwargs' tree), tensors in its arena.
BuildPlan = Callable[[StepBatch, dict[str, str]], tuple[list[Overlay], bytes]]


@dataclass
class PlanAhead:
    """A plan built for the predicted next step, waiting for its StepBegin."""

    step: int
    layout: StepLayout
    overlays: list[Overlay]
    extra_kwargs: bytes  # a tree (proto/plan_trees.py)
    errors: dict[str, str]
    event: int
    hook_us: float
    stacks: list[TensorRef]
    stacked_rows: int  # of its tensors, those sent as rows of a stack

    def answers(self, msg: StepBegin, layout: StepLayout) -> bool:
        """Is `msg` (its `layout` resolved) the step this plan was built for, bringing nothing else?"""
        if msg.step != self.step or msg.new_requests or msg.finished or msg.preempted or msg.want_states:
            return False
        if msg.model_hooks is not None or layout.input_ids is not None:
            return False
        want = self.layout
        return (layout.req_ids == want.req_ids and layout.query_start_loc == want.query_start_loc
                and layout.num_computed_tokens == want.num_computed_tokens
                and layout.prefill_lens == want.prefill_lens)


def next_decode_layout(layout: StepLayout) -> StepLayout | None:
    """The batch a steady decode step brings after `layout`: the same requests in the same rows,
    one decode row each, each one token further. None unless every request of `layout` had one
    decode row (a prefill chunk, several rows or input ids to know make the next batch unknown)."""
    req_ids = layout.req_ids
    n = len(req_ids)
    if not n or layout.input_ids is not None:
        return None
    qsl = layout.query_start_loc
    if qsl[n] != n or qsl[0] != 0 or any(qsl[i + 1] - qsl[i] != 1 for i in range(n)):
        return None
    computed, prefill = layout.num_computed_tokens, layout.prefill_lens
    if any(c < p for c, p in zip(computed, prefill)):  # a row before its prefill end: a prefill row
        return None
    return StepLayout(list(req_ids), list(qsl), [c + 1 for c in computed], list(prefill))


class PlansAhead:
    """One session's side of it: the step the last StepEnd ended, the plan built from it, counts."""

    def __init__(self, build: BuildPlan, arenas: Any, requests: dict[str, Any]) -> None:
        self._build = build
        self._arenas = arenas
        self._requests = requests  # the session's live requests (the dict itself)
        self._ended: tuple[int, StepLayout] | None = None
        self._plan: PlanAhead | None = None
        self.built = 0
        self.used = 0

    def note_ended(self, step: int, layout: StepLayout) -> None:
        self._ended = (step, layout)

    def drop(self) -> None:
        """The hooks' state changes (a request change, an append, a hand-over): what was built is stale."""
        self._ended = None
        self._plan = None

    def build(self) -> None:
        """The next step's plan, if the last StepEnd's batch predicts it (`next_decode_layout`) and
        every request of it is still live."""
        ended, self._ended = self._ended, None
        if ended is None:
            return
        step, ended_layout = ended
        layout = next_decode_layout(ended_layout)
        if layout is None or not all(r in self._requests for r in layout.req_ids):  # one finished with the step
            return
        t0 = time.perf_counter()
        errors: dict[str, str] = {}
        out = self._arenas.out
        if out is not None:
            out.reset()
        overlays, extra = self._build(StepBatch(step + 1, layout, self._requests), errors)
        event = out.seal() if out is not None else -1
        stacks, rows = (out.stacks, out.stacked_rows) if out is not None else ([], 0)
        self._plan = PlanAhead(step + 1, layout, overlays, extra, errors, event, (time.perf_counter() - t0) * 1e6,
                               stacks, rows)
        self.built += 1

    def take(self, msg: StepBegin, layout: StepLayout) -> PlanAhead | None:
        """The plan built for this StepBegin, if it is the one predicted; either way none is kept."""
        plan, self._plan = self._plan, None
        if plan is None or not plan.answers(msg, layout):
            return None
        self.used += 1
        return plan
