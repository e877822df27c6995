"""Streaming payloads: entries a client appends to a running request (AppendPayload).

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
- a request whose state the shim mirrors (the model's own hooks read it in the vLLM process):
  checked on arrival against its state plus the updates already sent, then sent at once as a
  MirrorUpdate (`seq`, its delta: the `embed.decode` rows past the span). The shim applies it
  at its next step start and says so in that step's StepStart (`mirror_seq`); only then does it
  enter the sidecar's state too and the client get `after_step` = that step - 1. A request that
  ends first, or a hot upgrade before the shim applied it (SwitchReady.mirror_seq), is an error.
- errors are the sending client's only (an ErrorReply): an unknown or finished request, or hooks
  refusing it (a bad payload, a gap in `embed.decode` spans, the state cap). The request's state
  stays as it was and it runs on; nothing else is disturbed.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from omni_sidecar.hook_api.hook_set import HookErrors
from omni_arena.tensor_tree import encode_inline
from proto.messages import AppendPayload, AppendReply, ErrorReply, Message, MirrorUpdate
from proto.settings import ERROR_TEXT_MAX

if TYPE_CHECKING:
    from omni_sidecar.sessions.session import Session
    from omni_sidecar.sessions.store import FinishedOutputs

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


@dataclass
class _Sent:
    """A MirrorUpdate the shim has not yet said it applied."""

    asked_as: str
    req_id: str
    entries: dict[str, Any]
    answer: Answer


class AppendQueue:
    """One session's appends: applied at once between steps, else queued until the step ends."""

    def __init__(self, session: Session) -> None:
        self.session = session
        self.last_step = -1  # the last step whose StepEnd was handled
        self._waiting: list[_Pending] = []
        self.to_shim: Answer | None = None  # the peer's send (MirrorUpdate), set by ShimPeer
        self._seq = 0  # the last MirrorUpdate sent on this connection
        # MirrorUpdates sent that the shim has not yet said it applied, by seq (a hand-over waits for
        # none); the dict itself, not a count: the serving loop looks at it for every StepStart.
        self.unacked: dict[int, _Sent] = {}

    def receive(self, msg: AppendPayload, answer: Answer) -> Message | None:
        """The reply now, or None: `answer` gets it when the step in flight has ended (or, for a
        mirrored request, when the shim applied it)."""
        session = self.session
        if session.model_hooks is not None and session.hooks.needs.model_states:
            return self._send_mirrored(msg, answer)
        if session.in_step:  # the step in flight sees it entirely or not at all: after it
            self._waiting.append(_Pending(msg.req_id, msg.payload, answer))
            return None
        return self._apply(msg.req_id, msg.payload)

    def step_ended(self, step: int) -> None:
        self.last_step = max(self.last_step, step)
        waiting, self._waiting = self._waiting, []
        for item in waiting:
            item.answer(self._apply(item.asked_as, item.payload))
        for seq, sent in list(self.unacked.items()):  # ended before the shim applied it: no step saw it
            if sent.req_id not in self.session.requests:
                del self.unacked[seq]
                sent.answer(unknown(sent.asked_as, self.session.finished_store))

    def mirror_applied(self, seq: int, step: int, final: bool = False) -> None:
        """The shim applied every MirrorUpdate up to `seq` before `step` (StepStart.mirror_seq), or,
        `final`, hands over after `step` - 1 (SwitchReady): later ones never reach its mirror."""
        for n in sorted(self.unacked):
            sent = self.unacked[n]
            if n > seq and not final:
                break
            del self.unacked[n]
            if n > seq:
                sent.answer(refused("append_refused", f"request {sent.asked_as!r}: not appended: the engine is "
                                    "handed over to a new sidecar (hot upgrade); append again"))
            elif sent.req_id not in self.session.requests:
                sent.answer(unknown(sent.asked_as, self.session.finished_store))
            else:
                sent.answer(self._commit(sent, step))

    def _commit(self, sent: _Sent, step: int) -> Message:
        self.session.drop_plan_ahead()  # built from the state this append changes
        try:
            self.session.hooks.commit_mirrored_append(sent.req_id, sent.entries)
        except Exception as exc:  # a hook bug: the model sees the append, the sidecar's state does not
            log.error("commit_mirrored_append raised %r", exc, exc_info=exc)
            return refused("append_refused", f"request {sent.asked_as!r}: in the model's state from step {step} "
                           f"on, but not in the sidecar's: commit_mirrored_append: {exc!r}")
        return AppendReply(req_id=sent.asked_as, after_step=step - 1)

    def abandon(self, reason: str) -> None:
        """The session ends: waiting appends were not applied."""
        waiting, self._waiting = self._waiting, []
        for item in waiting:
            item.answer(refused("session_ended", f"request {item.asked_as!r}: not appended: {reason}"))
        sent, self.unacked = self.unacked, {}
        for item in sent.values():
            item.answer(refused("session_ended", f"request {item.asked_as!r}: not appended: {reason}"))

    def _send_mirrored(self, msg: AppendPayload, answer: Answer) -> Message | None:
        session = self.session
        req_id = session.resolve(msg.req_id)
        if req_id is None:
            return unknown(msg.req_id, session.finished_store)
        if self.to_shim is None:
            return refused("append_refused", f"request {msg.req_id!r}: the model's own hooks read its state in "
                           "the vLLM process (the shim's mirror), and no shim connection can take the update")
        earlier = [s.entries for s in self.unacked.values() if s.req_id == req_id]
        try:
            entries = session.hooks.stage_mirrored_append(req_id, msg.payload, earlier)
            tree, blobs = encode_inline(entries)
            self.to_shim(MirrorUpdate(seq=self._seq + 1, req_id=req_id, entries=tree, blobs=blobs))
        except HookErrors as exc:
            return refused("append_refused", f"request {msg.req_id!r}: {exc.errors.get(req_id) or exc}")
        except Exception as exc:  # a hook bug, or the shim's ring broke: that client's error
            log.error("appending to mirrored request %s failed: %r", req_id, exc, exc_info=exc)
            return refused("append_refused", f"request {msg.req_id!r}: {exc!r}")
        self._seq += 1
        self.unacked[self._seq] = _Sent(msg.req_id, req_id, entries, answer)
        return None

    def _apply(self, asked_as: str, payload: bytes) -> Message:
        session = self.session
        req_id = session.resolve(asked_as)
        if req_id is None:  # finished while the append waited for the step to end
            return unknown(asked_as, session.finished_store)
        session.drop_plan_ahead()  # built from the state this append changes
        try:
            session.hooks.on_payload_appended(req_id, payload)
        except HookErrors as exc:
            return refused("append_refused", f"request {asked_as!r}: {exc.errors.get(req_id) or exc}")
        except Exception as exc:  # a hook bug: that client's error, the request runs on
            log.error("on_payload_appended raised %r", exc, exc_info=exc)
            return refused("append_refused", f"request {asked_as!r}: on_payload_appended: {exc!r}")
        return AppendReply(req_id=asked_as, after_step=self.last_step)
