"""Streaming payloads (AppendPayload): the sidecar side, driven without vLLM."""

from __future__ import annotations

import msgspec
import pytest
import torch

from omni_sidecar.hook_api.hook_set import OmniHooks, RequestHookError
from omni_sidecar.serve.metrics import SidecarMetrics
from omni_sidecar.hook_sets.omni.state_hooks import OmniStateHooks
from omni_sidecar.hook_sets.omni.state import IntermediateBuffer, StateError
from omni_sidecar.hook_sets.omni.wire import encode_additional_information
from omni_sidecar.serve.queries import Queries
from omni_sidecar.sessions.session import Session
from omni_sidecar.sessions.store import FinishedEntry, FinishedOutputs
from proto.codec import Codec
from proto.messages import (AppendPayload, AppendReply, BatchLayout, ErrorReply, Hello, ModelHooks, NewRequest,
                            StepBegin, StepEnd)
from proto.packed import packed_layout
from proto.version import PROTOCOL_MAJOR


class Recording(OmniStateHooks):
    """Records, per step, what each request's state holds (the appended part)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[int, str, list, tuple | None]] = []

    def process_model_output(self, batch, hidden_states) -> None:
        for req_id in batch.req_ids:
            state = self.state.get(req_id) or {}
            embed = state.get("embed", {})
            span = (embed["decode_token_start"], embed["decode_token_end"]) if "decode" in embed else None
            self.seen.append((batch.step, req_id, list(state.get("meta", {}).get("tags", [])), span))


def _payload(start: int, rows: int, tag: str) -> bytes:
    decode = torch.arange(start, start + rows, dtype=torch.float32).view(rows, 1).repeat(1, 2)
    nested = {"embed": {"decode": decode, "decode_token_start": start, "decode_token_end": start + rows},
              "meta": {"tags": [tag]}}
    return msgspec.msgpack.encode(encode_additional_information(nested))


def _session(hooks) -> tuple[Session, FinishedOutputs]:
    store = FinishedOutputs(10)
    hello = Hello(PROTOCOL_MAJOR, 0, "test", "none", "cpu", 0, 1, "m", 8, "float32", 8, [])
    return Session(1, hello, hooks, store, SidecarMetrics()), store


def _layout(step: int, req_ids=("r", "o")) -> BatchLayout:
    """One row per request, position `step` (each position reaches the hooks once: omni_sidecar/sessions/replays.py)."""
    n = len(req_ids)
    return packed_layout(list(req_ids), list(range(n + 1)), [step] * n, [1] * n)


def _step(session: Session, step: int, **kw) -> None:
    session.step_end(StepEnd(step, _layout(step), num_tokens=2, **kw))


def test_appends_reach_the_next_step_in_order_never_half_a_step():
    hooks = Recording()
    session, _ = _session(hooks)
    answers: list = []
    _step(session, 0, new_requests=[NewRequest("r", 1, [1], client_req_id="client-r"), NewRequest("o", 1, [2])])
    # Between steps: applied at once, by the client's id; step 0 was the last without it.
    reply = session.appends.receive(AppendPayload("client-r", _payload(0, 2, "a")), answers.append)
    assert reply == AppendReply("client-r", 0)
    _step(session, 1)
    # A step in flight (its StepBegin handled): appends wait, in order, until its StepEnd.
    session.step_begin(StepBegin(2, _layout(2)))
    assert session.appends.receive(AppendPayload("r", _payload(2, 3, "b")), answers.append) is None
    assert session.appends.receive(AppendPayload("r", _payload(7, 1, "gap")), answers.append) is None
    assert session.appends.receive(AppendPayload("r", _payload(4, 2, "c")), answers.append) is None
    assert answers == []
    session.step_end(StepEnd(2, None, num_tokens=2))
    assert answers[0] == AppendReply("r", 2) and answers[2] == AppendReply("r", 2)
    assert isinstance(answers[1], ErrorReply) and answers[1].code == "append_refused"
    assert "gap after [0, 5)" in answers[1].message
    _step(session, 3)
    per_step = {(s, r): (tags, span) for s, r, tags, span in hooks.seen}
    assert per_step[0, "r"] == ([], None)
    assert per_step[1, "r"] == (["a"], (0, 2))
    assert per_step[2, "r"] == (["a"], (0, 2))  # arrived mid-step: not seen by that step
    assert per_step[3, "r"] == (["c"], (0, 6))  # b then c merged in order; the gap left nothing
    assert all(per_step[s, "o"] == ([], None) for s in range(4))  # the other request is untouched
    decode = hooks.state.get("r")["embed"]["decode"]
    assert decode[:, 0].tolist() == [0, 1, 2, 3, 4, 5]
    assert session.errors_by_request == {} and session.errors == 0


def test_unknown_finished_and_ended_sessions_are_clear_errors():
    hooks = Recording()
    session, store = _session(hooks)
    answers: list = []
    _step(session, 0, new_requests=[NewRequest("r", 1, [1]), NewRequest("o", 1, [2])])
    session.step_begin(StepBegin(1, _layout(1)))
    session.appends.receive(AppendPayload("r", _payload(0, 1, "late")), answers.append)
    session.step_end(StepEnd(1, None, finished=["r"], num_tokens=2))  # "r" finished in the step the append waited for
    assert answers[0].code == "request_finished" and "has finished" in answers[0].message

    class Peers:
        def live_request(self, req_id):
            return (session, session.resolve(req_id)) if session.resolve(req_id) else None

        def send(self, ident, msg):
            answers.append((ident, msg))

    queries = Queries(hooks, Peers(), store)  # type: ignore[arg-type]
    assert queries.answer(b"c", AppendPayload("r", _payload(0, 1, "x"))).code == "request_finished"
    gone = queries.answer(b"c", AppendPayload("nobody", _payload(0, 1, "x")))
    assert gone.code == "unknown_request" and "'nobody' is not running" in gone.message
    assert queries.answer(b"c", AppendPayload("o", b"\x93garbage")).code == "append_refused"  # not the schema
    session.step_begin(StepBegin(2, _layout(2, ["o"])))
    assert queries.answer(b"c", AppendPayload("o", _payload(0, 1, "x"))) is None
    session.close()  # the shim went away mid-step
    assert answers[-1][0] == b"c" and answers[-1][1].code == "session_ended"


def test_a_request_whose_state_the_shim_mirrors_refuses_appends():
    session, _ = _session(Recording())
    session.step_end(StepEnd(0, _layout(0, ["t"]), [NewRequest("t", 1, [1])], num_tokens=1))
    session.model_hooks = ModelHooks(has_preprocess=True)
    reply = session.appends.receive(AppendPayload("t", _payload(0, 1, "x")), lambda m: None)
    assert reply.code == "append_refused" and "mirror" in reply.message


def test_hook_sets_refuse_appends_unless_they_take_them():
    with pytest.raises(RequestHookError, match="takes no appended payloads"):
        OmniHooks().on_payload_appended("r", b"")
    hooks = OmniStateHooks(state_cap_mib="0.0001")  # ~100 bytes
    with pytest.raises(RequestHookError, match="no state"):
        hooks.on_payload_appended("r", _payload(0, 1, "x"))
    hooks.state.create("r", {"meta": {"k": 1}})
    with pytest.raises(RequestHookError, match="over the cap"):
        hooks.on_payload_appended("r", _payload(0, 20, "x"))
    assert hooks.state.get("r") == {"meta": {"k": 1}}


def test_replace_appends_replace_the_state_keeping_its_progress():
    """vllm-omni's replace mode (a model declaring `replace_runtime_additional_information`): the
    append becomes the state; only `meta.num_processed_tokens` and `meta.resumable` carry over."""
    before = {"meta": {"num_processed_tokens": 5, "resumable": True, "tags": ["a"]}, "codes": {"audio": torch.ones(2)}}
    merged, replaced = OmniStateHooks(), OmniStateHooks(replace_appends="1")
    for hooks in (merged, replaced):
        hooks.state.create("r", {k: dict(v) for k, v in before.items()})
        hooks.on_payload_appended("r", _payload(0, 1, "b"))
    state = replaced.state.get("r")
    assert set(state) == {"meta", "embed"} and "codes" not in state
    assert state["meta"] == {"num_processed_tokens": 5, "resumable": True, "tags": ["b"]}
    assert state["embed"]["decode_token_end"] == 1
    assert set(merged.state.get("r")) == {"meta", "codes", "embed"}  # the default merges
    assert merged.state.get("r")["meta"]["num_processed_tokens"] == 5
    with pytest.raises(RequestHookError, match="replace_appends=1 cannot reach the state the shim mirrors"):
        replaced.stage_mirrored_append("r", _payload(1, 1, "c"), [])


def test_a_failed_merge_leaves_the_state_as_it_was():
    buf = IntermediateBuffer()
    buf.create("r", {"meta": {"a": 1}, "embed": {"decode": torch.zeros(2, 1), "decode_token_start": 0,
                                                 "decode_token_end": 2}})
    state = buf.get("r")
    meta, embed = state["meta"], state["embed"]
    with pytest.raises(StateError, match="gap"):
        buf.merge("r", {"meta": {"a": 2, "b": 3}, "codes": {"x": torch.ones(1)},
                        "embed": {"decode": torch.ones(1, 1), "decode_token_start": 5}})
    assert buf.get("r") is state and state["meta"] is meta and state["embed"] is embed
    assert set(state) == {"meta", "embed"} and meta == {"a": 1} and embed["decode_token_end"] == 2


def test_append_messages_round_trip_and_bound_the_id():
    codec = Codec()
    for msg in (AppendPayload("r", b"\x81"), AppendReply("r", -1)):
        assert codec.decode(codec.encode(msg)) == msg
    with pytest.raises(Exception):
        codec.decode(codec.encode(AppendPayload("x" * 300, b"")))


def test_finished_store_alone_names_the_request_finished():
    from omni_sidecar.sessions.appends import unknown

    store = FinishedOutputs(2)
    store.put("v1", FinishedEntry({}, []), client_id="mine")
    assert unknown("mine", store).code == "request_finished"
    assert unknown("v2", store).code == "unknown_request"


def test_a_successor_counts_steps_from_where_its_predecessor_was():
    old, _ = _session(Recording())
    _step(old, 0, new_requests=[NewRequest("r", 1, [1]), NewRequest("o", 1, [2])])
    _step(old, 1)
    new, _ = _session(Recording())
    new.hooks.import_state(old.hooks.export_state())
    new.import_(msgspec.msgpack.decode(msgspec.msgpack.encode(old.export())))
    assert new.appends.receive(AppendPayload("r", _payload(0, 1, "x")), lambda m: None) == AppendReply("r", 1)
