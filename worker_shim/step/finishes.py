"""Requests the shim sees finish before vLLM's scheduler says so.

vLLM tells the worker that a request finished only in the NEXT step's
`finished_req_ids`; an engine that goes idle (an offline `LLM.generate`
returning its last outputs) or exits runs no next step, and the sidecar would
learn of the finish late or never. So the shim watches what it can see itself
(docs/ARCHITECTURE.md, "Finish notices"):

- length: a row whose sample this step brings the request to `max_tokens`
  finishes with this step, whatever token it samples; the StepEnd of this step
  already says so (the sidecar finishes it after this step's hooks ran), or with
  async scheduling the next step's (worker_shim/step/discards.py);
- stop tokens: the last step's sampled ids, read only at shutdown (so no step
  ever waits for the device), tell which live requests ended on EOS or a stop
  token id; at a clean shutdown those are complete, the rest were cut short.
  With async scheduling a request that stopped in the step before the last may
  have run once more in the last (worker_shim/step/discards.py): the two last
  steps' ids tell, and that forward is reported discarded.

Stop strings are matched by vLLM's detokenizer in the front end; the worker
cannot see them, so such requests finish on vLLM's own finish notice.
With speculative decoding the rows' sample counts are not known before
verification, so length detection is off there.
"""

from __future__ import annotations

import logging
from typing import Any, Iterable

import numpy as np

from proto.messages import Discarded

log = logging.getLogger("vllm.omni_sidecar.shim.finishes")
_NEVER = np.iinfo(np.int64).max


class FinishWatch:
    def __init__(self, length_detection: bool = True) -> None:
        self.length_detection = length_detection
        self._stop_ids: dict[str, frozenset[int]] = {}
        self._last_position: dict[str, int] = {}
        self.told_early: set[str] = set()  # finishes the sidecar already has from us
        # The last two steps' sampler outputs with their step numbers (ids read at shutdown).
        self._last_sampled: tuple[int, Any] | None = None
        self._sampled_before: tuple[int, Any] | None = None
        # The batch's last positions in row order, kept while the batch's rows stay the same
        # requests (steady decode): rebuilding them costs a dict look-up per row every step.
        self._rows_ids: list[str] | None = None
        self._rows_last: np.ndarray | None = None
        self._rows_last_before: np.ndarray | None = None  # minus one: the position a last decode row starts at
        # Steady decode: the fewest steps any row had to go before its last one when the rows were last
        # compared (0: compare the whole batch next step), and the steady steps seen since.
        self._steady_slack = 0
        self._steady_steps = 0
        self.batch_compares = 0  # whole-batch comparisons made (tests: steady decode makes one)

    def note_new(self, req: Any, prompt_len: int) -> None:
        sp = getattr(req, "sampling_params", None)
        if sp is None:  # pooling requests: nothing is sampled
            return
        stop = set(getattr(sp, "stop_token_ids", None) or ())
        eos = getattr(sp, "eos_token_id", None)  # None when ignore_eos
        if eos is not None:
            stop.add(int(eos))
        max_tokens = getattr(sp, "max_tokens", None)
        self._stop_ids[req.req_id] = frozenset(stop)
        if max_tokens is not None:
            # Computed tokens after the step that samples the last output: prompt + max_tokens - 1.
            self._last_position[req.req_id] = prompt_len + max_tokens - 1
            self.forget_rows()

    def by_length(self, batch: Any) -> list[str]:
        """Requests whose sample in this step is their last (`max_tokens` reached).

        Runs every step: in steady decode a count, else one vectorized comparison; Python only
        for the rows that finish."""
        if not self.length_detection or not self._last_position:
            return []
        ids = batch.req_ids
        n = len(ids)
        if not n:
            return []
        qsl = batch.query_start_loc_np
        counts = batch.num_computed_tokens_np
        decode = qsl.item(n) == n  # one row each: computed after this step = computed + 1
        if ids != self._rows_ids:  # the same strings in the same rows: a cheap comparison
            self._rows_ids = list(ids)
            self._rows_last = np.fromiter((self._last_position.get(r, _NEVER) for r in ids), dtype=np.int64, count=n)
            # In the dtype of vLLM's counts (int32), clipped: a comparison of one dtype needs no cast.
            top = np.iinfo(counts.dtype).max if counts.dtype.kind == "i" else _NEVER
            self._rows_last_before = np.minimum(self._rows_last - 1, top).astype(counts.dtype)
        elif decode and self._steady_slack:
            # The same requests in the same rows, one token each, every step since the rows were last
            # compared: a row advances at most one a step (or goes back: vLLM's recompute after a
            # failed KV load keeps it in the batch), so none reaches its last position in fewer steps
            # than the slack. Counted over the steps this watch was shown: one it was not ends the
            # count (`forget_rows`). A whole-batch comparison costs ~5 µs of numpy on the cold cache a
            # forward leaves (2-core VM).
            self._steady_steps += 1
            if self._steady_steps < self._steady_slack:
                return []
        computed = counts[:n]
        self._steady_slack = 0
        self.batch_compares += 1
        if decode:
            slack = int((self._rows_last_before - computed).min())
            if slack > 0:
                self._steady_slack, self._steady_steps = slack, 0
                return []
        upto = computed + qsl[1:n + 1] - qsl[:n]  # computed after this step
        reached = upto >= self._rows_last
        if not reached.any():
            return []
        rows = np.flatnonzero(reached & (upto >= batch.prefill_len_np[:n]))
        done = [ids[i] for i in rows if ids[i] not in self.told_early]
        self.told_early.update(done)
        return done

    def forget_rows(self) -> None:
        """A step whose batch this watch did not see (the link had no sidecar): its rows may have
        changed and come back; compare the whole batch next time."""
        self._rows_ids = None

    def already_told(self, finished: Iterable[str]) -> set[str]:
        """Of vLLM's finish notices, those the sidecar has from us already (then forgotten here)."""
        if not finished:
            return set()
        told = {r for r in finished if r in self.told_early}
        for req_id in finished:
            self._stop_ids.pop(req_id, None)
            self._last_position.pop(req_id, None)
            self.told_early.discard(req_id)
        self.forget_rows()
        return told

    def note_sampled(self, step: int, output: Any) -> None:
        self._sampled_before, self._last_sampled = self._last_sampled, (step, output)

    def stopped_by_token(self, async_scheduling: bool = False) -> tuple[set[str], list[Discarded]]:
        """Requests whose last kept sample was a stop token id, and the discarded forwards among
        the last step's: with `async_scheduling`, a request that sampled a stop token in the step
        before the last and ran in the last too (that sample vLLM discards)."""
        if self._last_sampled is None:
            return set(), []
        step, output = self._last_sampled
        last = _sampled_ids(output)
        stopped = {r for r, tok in last.items() if self._stops(r, tok)}
        if not async_scheduling or self._sampled_before is None:
            return stopped, []
        before = _sampled_ids(self._sampled_before[1])
        ran_on = sorted(r for r, tok in before.items() if self._stops(r, tok) and r in last)
        stopped.update(r for r, tok in before.items() if self._stops(r, tok))
        return stopped, [Discarded(r, step) for r in ran_on]

    def _stops(self, req_id: str, token: int | None) -> bool:
        return token is not None and token in self._stop_ids.get(req_id, ())


def _sampled_ids(output: Any) -> dict[str, int | None]:
    """req_id -> last token sampled in that step, from V2's AsyncOutput or a ModelRunnerOutput.

    Waits for the output's device copy (only ever called at shutdown); {} if unreadable."""
    if output is None:
        return {}
    try:
        event = getattr(output, "copy_event", None)
        if event is not None:
            event.synchronize()
        mro = getattr(output, "model_runner_output", output)
        req_ids = list(mro.req_ids)
        tokens = getattr(output, "sampled_token_ids", None)
        if tokens is None:
            tokens = mro.sampled_token_ids
        counts = getattr(output, "num_sampled_tokens_np", None)
        out: dict[str, int | None] = {}
        for i, req_id in enumerate(req_ids):
            row = list(tokens[i])
            k = int(counts[i]) if counts is not None else len(row)
            out[req_id] = int(row[k - 1]) if k > 0 else None
        return out
    except Exception as exc:  # an upstream shape we do not know: treat every request as cut short
        log.warning("could not read the last step's sampled tokens (%s); live requests at shutdown "
                    "are reported as cut short", exc)
        return {}
