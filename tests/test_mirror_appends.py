"""Appends to requests whose state the shim mirrors (MirrorUpdate): ordering and acks.

The sidecar checks an append on arrival against the state plus the updates already sent, sends
its delta at once (the `embed.decode` rows past the span), and applies them to its own state (and answers the client) only when
a StepStart says the shim applied them; a request that ends first or a hot upgrade before the
shim applied it is a clear error, never a half-applied append.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import torch

from omni_arena.tensor_tree import decode_inline, encode_inline
from omni_sidecar.serve.peers import ShimPeer
from proto.codec import Codec
from proto.messages import (AppendPayload, AppendReply, ErrorReply, Hello, MirrorUpdate, ModelHooks, NewRequest,
                            StepEnd, StepStart, SwitchReady)
from proto.version import PROTOCOL_MAJOR
from tests.test_appends import Recording, _layout, _payload
from omni_sidecar.serve.metrics import SidecarMetrics
from omni_sidecar.sessions.session import Session
from omni_sidecar.sessions.store import FinishedOutputs
from tests.test_recovery import FakeConnection
from worker_shim.step.link import SidecarLink
from worker_shim.model.state_mirror import StateMirror


def _entries(update: MirrorUpdate) -> dict:
    """An update's entries as the shim reads them."""
    return decode_inline(update.entries, update.blobs)


def _mirrored(to_shim: bool = True):
    """A session serving a model with its own hooks; request "t" holds embed.decode rows [0, 2)."""
    hello = Hello(PROTOCOL_MAJOR, 0, "test", "none", "cpu", 0, 1, "m", 8, "float32", 8, [])
    session = Session(1, hello, Recording(), FinishedOutputs(10), SidecarMetrics())
    peer = ShimPeer(b"shim", session, listener=None, codec=Codec())  # type: ignore[arg-type]
    sent: list[MirrorUpdate] = []
    session.appends.to_shim = sent.append if to_shim else None  # what the peer would write to the shim
    session.step_end(StepEnd(0, _layout(0, ["t"]), [NewRequest("t", 1, [1], {})], num_tokens=1))
    session.hooks.state.create("t", {"embed": {"decode": torch.zeros(2, 2), "decode_token_start": 0,
                                               "decode_token_end": 2}})
    session.model_hooks = ModelHooks(has_preprocess=True)
    return session, peer, sent


def _append(session, start: int, rows: int, tag: str, answers: list):
    return session.appends.receive(AppendPayload("t", _payload(start, rows, tag)), answers.append)


def test_sent_at_once_applied_and_answered_when_the_shim_says_so():
    session, peer, sent = _mirrored()
    mirror = StateMirror()  # the shim's, filled from the sidecar's state (StepPlan.model_states)
    mirror.fill("t", session.hooks.model_states(["t"])["t"])
    answers: list = []
    assert _append(session, 2, 1, "a", answers) is None
    # Contiguous with the update already sent, not with the state: checked against both;
    # overlapping it, so only the rows past it travel.
    assert _append(session, 2, 2, "b", answers) is None
    gap = _append(session, 9, 1, "c", answers)
    assert isinstance(gap, ErrorReply) and gap.code == "append_refused" and "gap" in gap.message
    assert [u.seq for u in sent] == [1, 2] and answers == []
    second = _entries(Codec().decode(Codec().encode(sent[1])))
    assert second["embed"]["decode_token_start"] == 3 and second["embed"]["decode_token_end"] == 4
    assert second["embed"]["decode"][:, 0].tolist() == [3]
    state = session.hooks.state.get("t")
    assert state["embed"]["decode_token_end"] == 2 and "tags" not in state["meta"]  # not before the shim applied it

    mirror.apply_appended("t", _entries(sent[0]))
    peer.note_step(StepStart(step=5, mirror_seq=1))  # step 5 is the first that saw update 1
    assert answers == [AppendReply("t", after_step=4)]
    assert session.hooks.state.get("t")["embed"]["decode_token_end"] == 3
    assert not peer.idle(time.monotonic() + 60, 0.0)  # update 2 in flight: no hand-over yet
    peer.note_step(StepEnd(5))
    mirror.apply_appended("t", _entries(sent[1]))
    peer.note_step(StepStart(step=6, mirror_seq=2))
    peer.note_step(StepEnd(6))
    assert answers[1] == AppendReply("t", after_step=5)
    assert peer.idle(time.monotonic() + 60, 0.0)
    # Both sides hold the same state, and the mirror did not count it as a model update.
    mine, theirs = mirror.states["t"], session.hooks.state.get("t")
    assert mine["meta"] == theirs["meta"] and theirs["meta"]["tags"] == ["b"]
    assert torch.equal(mine["embed"]["decode"], theirs["embed"]["decode"])
    assert theirs["embed"]["decode"][:, 0].tolist() == [0, 0, 2, 3]
    assert mine["embed"]["decode_token_end"] == theirs["embed"]["decode_token_end"] == 4
    assert mirror.take_step() == ({}, {})


def test_a_request_that_ends_first_and_a_hot_upgrade_are_errors_never_half_applied():
    session, peer, sent = _mirrored()
    answers: list = []
    _append(session, 2, 1, "a", answers)
    session.step_end(StepEnd(1, finished=["t"]))  # vLLM finished it before the shim applied the update
    assert answers[0].code == "request_finished"
    peer.note_step(StepStart(step=2, mirror_seq=1))  # applied to a mirror that no longer holds it
    assert len(answers) == 1

    session, peer, sent = _mirrored()
    answers = []
    _append(session, 2, 1, "a", answers)
    _append(session, 3, 1, "b", answers)
    # The shim switches to a successor after applying update 1 only (update 2 stays in the old connection).
    peer.note_switch_ready(SwitchReady(last_step=7, mirror_seq=1))
    assert answers[0] == AppendReply("t", after_step=7)
    assert answers[1].code == "append_refused" and "hot upgrade" in answers[1].message
    exported = session.hooks.export_state()["states"]["t"]
    assert exported["embed"]["decode_token_end"] == 3 and exported["meta"]["tags"] == ["a"]
    assert peer.idle(time.monotonic(), 0.0)


def test_no_shim_to_update_is_a_refusal_and_a_lost_session_answers():
    session, _, sent = _mirrored(to_shim=False)
    reply = _append(session, 2, 1, "a", [])
    assert reply.code == "append_refused" and "mirror" in reply.message and sent == []
    session, _, sent = _mirrored()
    answers: list = []
    _append(session, 2, 1, "a", answers)
    session.close()
    assert answers[0].code == "session_ended" and not session.appends.unacked


class MirrorConnection(FakeConnection):
    """A sidecar's connection holding MirrorUpdates that arrived since the last step."""

    def __init__(self) -> None:
        super().__init__()
        self.welcome = SimpleNamespace(session=7)
        self.held = [MirrorUpdate(1, "t", *encode_inline({"meta": {"probe": 1}})),
                     MirrorUpdate(2, "t", *encode_inline({"meta": {"probe": 2}}))]
        self.log: list = []

    def take_mirror_updates(self):
        held, self.held = self.held, []
        self.mirror_seq = held[-1].seq if held else self.mirror_seq
        return [(u.req_id, _entries(u)) for u in held]

    def announce_step(self, step: int, answer_after_s: float) -> None:
        self.log.append(("StepStart", step, self.mirror_seq))


def test_the_shim_applies_held_updates_before_the_steps_start_and_says_so_in_it():
    conn = MirrorConnection()
    link = SidecarLink(lambda **kw: None, conn)
    link.mirror_sink = lambda req_id, entries: conn.log.append(("apply", req_id, entries["meta"]["probe"]))
    link.begin_step()
    assert conn.log == [("apply", "t", 1), ("apply", "t", 2), ("StepStart", 0, 2)]
