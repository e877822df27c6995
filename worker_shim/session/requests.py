"""What the connected sidecar knows of vLLM's requests.

`SessionRequests` holds the requests admitted to the current sidecar session and
feeds the step protocol's notices (new, finished, preempted) queued for the next
step message; a lost session ends here, naming the requests its loss fails. `FailureReports` holds
every request the sidecar failed (hook errors, losses), for the worker's stats
and, once, for the next sidecar so clients get `RequestFailed`.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Iterable

from proto.messages import NewRequest, RequestError, StepResult
from proto.settings import ERROR_TEXT_MAX
from worker_shim.config import LossPolicy
from worker_shim.step.batch import PayloadTracker
from worker_shim.step.protocol import Notices

log = logging.getLogger("vllm.omni_sidecar.shim.requests")
MAX_PENDING_FAILURES = 100_000


class SessionRequests:
    def __init__(self, payloads: PayloadTracker) -> None:
        self.payloads = payloads  # shared with TP: which live requests carry a payload
        self.live: set[str] = set()  # admitted to the current session, not finished
        self.notices = Notices()

    def admit(self, msg: NewRequest) -> None:
        self.live.add(msg.req_id)
        self.notices.new.append(msg)

    def note_finished(self, finished: Iterable[str], preempted: Iterable[str]) -> None:
        """vLLM frees both kinds in finish_requests; the sidecar keeps state for preempted ones."""
        finished = sorted(finished)
        self.notices.finished.extend(finished)
        self.live.difference_update(finished)
        self.notices.preempted.extend(sorted(preempted))

    def end_session(self, policy: LossPolicy) -> list[str]:
        """The sidecar is gone: forget what it knew; returns the requests its loss fails.

        Finish notices stay queued: the next sidecar learns them (for requests it never
        saw they are no-ops).
        """
        if policy == "fail-all":
            affected = sorted(self.live)
        else:
            affected = sorted(r for r in self.live if self.payloads.carries_payload(r))
        self.live.clear()
        self.notices.new, self.notices.preempted = [], []
        return affected


class FailureReports:
    def __init__(self, client_id_of: Callable[[str], str] = lambda req_id: "") -> None:
        self.request_errors: dict[str, str] = {}
        self.pending: list[RequestError] = []  # to tell the next sidecar
        self._client_id_of = client_id_of

    def fail(self, req_id: str, message: str) -> None:
        self.request_errors[req_id] = message
        if len(self.pending) < MAX_PENDING_FAILURES:
            self.pending.append(RequestError(req_id, message[:ERROR_TEXT_MAX], self._client_id_of(req_id)))

    def note_results(self, results: list[StepResult]) -> None:
        """The hook errors step results carry."""
        for result in results:
            self.record(result.errors)

    def record(self, errors: list[Any]) -> None:
        """Hook errors the sidecar reported (it already told its clients)."""
        for err in errors:
            if err.req_id not in self.request_errors:
                log.error("omni-sidecar hook error for request %s: %s", err.req_id, err.message)
            self.request_errors[err.req_id] = err.message

    def take_pending(self) -> list[RequestError]:
        pending, self.pending = self.pending, []
        return pending
