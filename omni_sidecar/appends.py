"""Streaming payloads: entries a client appends to a running request (AppendPayload, protocol 1.3).

vllm-omni streams a stage's inputs into requests that already run (per-step
additional_information for cached requests, "async chunk"); here a control client, or the
previous stage's sidecar, sends vllm-omni's additional_information bytes for a request named
by vLLM's id or by the client's own (as OutputsQuery does). The request's session applies it
through the hook set's `on_payload_appended` (docs/ARCHITECTURE.md, Streaming payloads):

- between two steps only: an append that arrives while a step is in flight in the sidecar
  (its StepBegin was handled, its StepEnd not yet) waits, in arrival order, until that
  step's StepEnd was handled, and is answered then. The hooks of one step therefore see an
  append entirely or not at all, and every later step sees it; `AppendReply.after_step` is the
  last step that did not.
- errors are the sending client's only (an ErrorReply): an unknown or finished request, a
  request whose state the model's own hooks read in the vLLM process (the shim's mirror, which
  appends do not reach), or hooks refusing it (a bad payload, a gap in `embed.decode` spans, the
  state cap). The request's state stays as it was and it runs on; nothing else is disturbed.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from omni_sidecar.hooks import HookErrors
from proto.messages import AppendPayload, AppendReply, ErrorReply, Message
from proto.settings import ERROR_TEXT_MAX

if TYPE_CHECKING:
    from omni_sidecar.session import Session
    from omni_sidecar.store import FinishedOutputs

log = logging.getLogger("omni_sidecar.appends")
Answer = Callable[[Message], None]


def refused(code: str, message: str) -> ErrorReply:
    return ErrorReply(code=code, message=message[:ERROR_TEXT_MAX])


def unknown(req_id: str, finished: FinishedOutputs) -> ErrorReply:
    """The error for a request no session runs: finished (its outputs are still kept) or unknown."""
    if finished.get(req_id) is not None:
        return refused("request_finished", f"request {req_id!r} has finished: nothing can be appended to it")
    return refused("unknown_request", f"request {req_id!r} is not running on this sidecar (unknown or finished)")


@dataclass
class _Pending:
    asked_as: str  # the id the client named
    payload: bytes
    answer: Answer


class AppendQueue:
    """One session's appends: applied at once between steps, else queued until the step ends."""

    def __init__(self, session: Session) -> None:
        self.session = session
        self.in_step = False
        self.last_step = -1  # the last step whose StepEnd was handled
        self._waiting: list[_Pending] = []

    def receive(self, msg: AppendPayload, answer: Answer) -> Message | None:
        """The reply now, or None: `answer` gets it when the step in flight has ended."""
        if self.in_step:
            self._waiting.append(_Pending(msg.req_id, msg.payload, answer))
            return None
        return self._apply(msg.req_id, msg.payload)

    def step_began(self) -> None:
        self.in_step = True

    def step_ended(self, step: int) -> None:
        self.in_step = False
        self.last_step = max(self.last_step, step)
        waiting, self._waiting = self._waiting, []
        for item in waiting:
            item.answer(self._apply(item.asked_as, item.payload))

    def abandon(self, reason: str) -> None:
        """The session ends: waiting appends were not applied."""
        waiting, self._waiting = self._waiting, []
        for item in waiting:
            item.answer(refused("session_ended", f"request {item.asked_as!r}: not appended: {reason}"))

    def _apply(self, asked_as: str, payload: bytes) -> Message:
        session = self.session
        req_id = session.resolve(asked_as)
        if req_id is None:  # finished while the append waited for the step to end
            return unknown(asked_as, session.finished_store)
        if session.model_hooks is not None and session.hooks.needs.model_states:
            return refused("append_refused", f"request {asked_as!r}: the model's own hooks read its state in the "
                           "vLLM process (the shim's mirror), which appended payloads do not reach")
        try:
            session.hooks.on_payload_appended(req_id, payload)
        except HookErrors as exc:
            return refused("append_refused", f"request {asked_as!r}: {exc.errors.get(req_id) or exc}")
        except Exception as exc:  # a hook bug: that client's error, the request runs on
            log.error("on_payload_appended raised %r", exc, exc_info=exc)
            return refused("append_refused", f"request {asked_as!r}: on_payload_appended: {exc!r}")
        return AppendReply(req_id=asked_as, after_step=self.last_step)
