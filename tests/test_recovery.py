"""The shim's loss / reconnect / switch state machine, driven through the link with fake connections.

Each transition of worker_shim/session/recovery.py has a test here that fails if it is removed:
connected -> lost (peer gone, step error, failed switch), lost -> connected (reconnect),
lost -> lost (retry with a fresh connection), connected -> switching -> connected,
connected -> connected on a kept unsolicited SwitchAck (idle hand-over), also when it
comes in answer to the step's StepStart; connected -> lost on an unanswered StepStart.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import numpy as np
import pytest

from proto.messages import HookNeeds, RequestError, StepEnd, StepResult, StepTick, SwitchAck, SwitchReady
from worker_shim.session import recovery
from worker_shim.errors import SidecarError
from worker_shim.step.link import SidecarLink


class FakeConnection:
    """A RecoveryPort (worker_shim/step/port.py) with no socket behind it, its own ReplyChannel."""

    def __init__(self, endpoint: str = "ipc:///nonexistent/omni-test.sock", ready: bool = True,
                 ack: SwitchAck | None = None, needs: HookNeeds | None = None) -> None:
        self.endpoint = endpoint
        self.step_timeout_s = 1.0
        self.needs = needs or HookNeeds()
        self.hook_set = "fake"
        self.welcome = SimpleNamespace(session=7)
        self.arena_kind = "shm"
        self.started = 0.0
        self.ready = ready
        self.ack = ack
        self.switch_ack: SwitchAck | None = None  # kept by the channel when sent unsolicited
        self.switch_to = ""  # kept by the channel from a result that asked for a switch
        self.mirror_seq = 0
        self.gone = False
        self.closed = False
        self.hello_sent = False
        self.connected = False
        self.refuse_connect: Exception | None = None
        self.fail_send: Exception | None = None
        self.fail_call: Exception | None = None
        self.sent: list = []
        self.calls: list = []
        self.results: list[StepResult] = []
        self.last_sent_step = -1
        self.last_answered_step = -1
        self.syncs = 0
        self.pongs_due = 0  # the real one defers a quiet spell's answer; announce_step answers here
        self.mirror_updates: list = []
        self.channel = self
        self.peer_req_ids = None
        self.sends_hidden = False
        self.announced: list[int] = []
        self.step_open = False
        self.ack_at_announce: SwitchAck | None = None  # handed over just before it read our StepStart
        self.fail_announce: Exception | None = None

    # handshake
    def start(self) -> None:
        self.hello_sent = True

    def poll(self, wait_ms: int = 0) -> bool:
        return self.ready

    def connect(self, timeout_s: float) -> None:
        if self.refuse_connect is not None:
            raise self.refuse_connect
        self.connected = True

    # traffic
    def peer_gone(self) -> bool:
        return self.gone

    def send(self, msg) -> None:
        if self.fail_send is not None:
            raise self.fail_send
        self.sent.append(msg)
        if isinstance(msg, StepEnd):
            self.last_sent_step = self.last_answered_step = msg.step
            self.step_open = False
        elif isinstance(msg, StepTick):
            self.last_sent_step = msg.step
            self.step_open = False

    def poll_ring_results(self) -> list[StepResult]:
        return self.take_results()

    def await_pongs(self) -> None:
        self.pongs_due = 0

    def sync(self) -> None:
        self.syncs += 1

    def call(self, msg, want):
        if self.fail_call is not None:
            raise self.fail_call
        self.calls.append(msg)
        return self.ack

    def step_plan(self, msg):
        return self.call(msg, None)

    def ask_plan(self, msg) -> None:  # the early StepBegin (SidecarLink.ask_early)
        if self.fail_send is not None:
            raise self.fail_send
        self.calls.append(msg)

    def take_plan(self, msg):
        if self.fail_call is not None:
            raise self.fail_call
        return self.ack

    def announce_step(self, step: int, answer_after_s: float) -> None:
        self.announced.append(step)
        self.step_open = True
        if self.ack_at_announce is not None:
            self.switch_ack = self.ack_at_announce
            raise SidecarError("the sidecar handed this session over to its successor")
        if self.fail_announce is not None:
            raise self.fail_announce

    def take_results(self, until_step=None) -> list[StepResult]:
        out, self.results = self.results, []
        for result in out:  # as the channel keeps it when the result arrives
            self.switch_to = result.switch_to or self.switch_to
        return out

    def stats(self) -> dict:
        return {"arena_kind": self.arena_kind, "arena_opens": {}, "ring_counts": {}}

    def close(self) -> None:
        self.closed = True


class Factory:
    """The link's `connect`: hands out prepared fake connections and records the arguments."""

    def __init__(self, *conns: FakeConnection) -> None:
        self.conns = list(conns)
        self.made: list[tuple[FakeConnection, dict]] = []

    def __call__(self, **kwargs) -> FakeConnection:
        conn = self.conns.pop(0)
        self.made.append((conn, kwargs))
        return conn


def request(req_id: str, payload: bool) -> SimpleNamespace:
    extra = {"omni_sidecar": {"x": 1}} if payload else None
    return SimpleNamespace(req_id=req_id, prompt_token_ids=[1, 2, 3], prompt_len=3,
                           sampling_params=SimpleNamespace(extra_args=extra))


def step_state(req_ids: list[str]) -> SimpleNamespace:
    n = len(req_ids)
    batch = SimpleNamespace(req_ids=req_ids, num_tokens=n,
                            query_start_loc_np=np.arange(n + 1), num_computed_tokens_np=np.zeros(n, int),
                            prefill_len_np=np.full(n, 3))
    return SimpleNamespace(input_batch=batch, hidden_states=None)


def run_step(link: SidecarLink, req_ids: list[str]) -> None:
    link.begin_step()
    link.end_step(step_state(req_ids))


def served_link(policy: str = "fail-all", factory: Factory | None = None) -> tuple[SidecarLink, FakeConnection]:
    first = FakeConnection()
    link = SidecarLink(factory or Factory(), first, loss_policy=policy)
    link.note_new([request("plain", False), request("carrier", True)])
    run_step(link, ["plain", "carrier"])
    assert first.sent and first.last_sent_step == 0
    return link, first


def test_a_vanished_sidecar_is_lost_and_every_request_it_served_fails():
    link, first = served_link("fail-all")
    first.gone = True
    link.begin_step()
    assert link.recovery.state == "lost" and link.conn is None and first.closed
    assert link.recovery.losses == 1
    assert set(link.failures.request_errors) == {"plain", "carrier"}
    assert "omni-sidecar lost" in link.failures.request_errors["plain"]


def test_fail_payload_policy_fails_only_requests_that_carry_a_payload():
    link, first = served_link("fail-payload")
    first.gone = True
    link.begin_step()
    assert link.recovery.state == "lost"
    assert set(link.failures.request_errors) == {"carrier"}


def test_requests_arriving_while_lost_fail_per_policy():
    for policy, failed in (("fail-all", {"late-plain", "late-carrier"}), ("fail-payload", {"late-carrier"})):
        link, first = served_link(policy, Factory(FakeConnection(ready=False)))
        first.gone = True
        link.begin_step()
        link.end_step(None)
        link.failures.request_errors.clear()
        link.note_new([request("late-plain", False), request("late-carrier", True)])
        assert set(link.failures.request_errors) == failed, policy


def test_a_step_message_that_fails_loses_the_sidecar():
    link, first = served_link()
    first.fail_send = SidecarError("omni-sidecar did not answer")
    run_step(link, ["plain", "carrier"])
    assert link.recovery.state == "lost" and link.recovery.losses == 1 and first.closed
    assert "did not answer" in link.failures.request_errors["plain"]


def test_reconnect_brings_a_fresh_sidecar_which_learns_the_failures():
    second = FakeConnection()
    link, first = served_link("fail-all", Factory(second))
    first.gone = True
    link.begin_step()  # lost
    link.end_step(None)
    run_step(link, ["plain", "carrier"])  # the reconnect: Hello, Welcome, then this step's StepEnd
    assert second.hello_sent and link.conn is second
    assert link.recovery.state == "connected" and link.recovery.reconnects == 1
    (end,) = second.sent
    assert {e.req_id for e in end.failed} == {"plain", "carrier"}
    assert end.batch.req_ids == ["plain", "carrier"]  # a new sidecar gets the full layout again
    assert link.failures.pending == []  # told once


def test_a_reconnect_attempt_without_welcome_is_replaced_after_the_retry_window(monkeypatch):
    silent, fresh = FakeConnection(ready=False), FakeConnection()
    link, first = served_link("fail-all", Factory(silent, fresh))
    first.gone = True
    link.begin_step()
    link.end_step(None)
    monkeypatch.setattr(recovery, "RETRY_AFTER_S", -1.0)  # the window has passed
    run_step(link, [])
    assert silent.hello_sent and silent.closed and link.recovery.state == "lost"
    monkeypatch.setattr(recovery, "RETRY_AFTER_S", 10.0)
    run_step(link, [])
    assert link.conn is fresh and link.recovery.reconnects == 1


def test_a_reconnect_attempt_whose_sidecar_went_away_unanswered_is_replaced_at_once():
    """Its Hello went with the connection: waiting out the retry window would wait for nothing."""
    silent, fresh = FakeConnection(ready=False), FakeConnection()
    link, first = served_link("fail-all", Factory(silent, fresh))
    first.gone = True
    link.begin_step()
    link.end_step(None)
    silent.gone = True
    run_step(link, [])
    assert silent.hello_sent and silent.closed and link.recovery.state == "lost"
    run_step(link, [])
    assert link.conn is fresh and link.recovery.reconnects == 1


def test_an_idle_link_takes_up_a_restarted_sidecar_and_tells_it_the_failures_at_once():
    second = FakeConnection()
    link, first = served_link("fail-all", Factory(second))
    first.gone = True
    link.begin_step()  # lost: "plain" and "carrier" fail
    link.end_step(None)
    assert link.reconnect_idle() and link.conn is second and link.recovery.reconnects == 1
    (end,) = second.sent  # no step ran: a StepEnd of no forward carries them
    assert {e.req_id for e in end.failed} == {"plain", "carrier"} and end.batch is None and end.num_tokens == 0
    assert link.failures.pending == []
    run_step(link, [])
    assert second.sent[-1].step == end.step + 1  # the next step numbers on


def test_a_sidecar_gone_while_vllm_idled_is_replaced_between_steps():
    second = FakeConnection()
    link, first = served_link("fail-all", Factory(second))
    first.gone = True  # no step ran since
    assert link.reconnect_idle() and first.closed and link.conn is second
    assert link.recovery.losses == 1 and {e.req_id for e in second.sent[-1].failed} == {"plain", "carrier"}


def test_an_idle_reconnect_leaves_a_session_handed_over_to_the_next_step():
    link, first = served_link()
    first.gone = True
    first.results = [StepResult(step=0, switch_to="ipc:///nonexistent/successor.sock")]  # read when gone
    assert link.reconnect_idle() and link.conn is first and link.recovery.losses == 0


def test_an_idle_reconnect_leaves_a_step_in_progress_and_a_live_sidecar_alone():
    link, first = served_link()
    assert link.reconnect_idle() and link.conn is first and first.sent[-1].step == 0
    silent, still_silent = FakeConnection(ready=False), FakeConnection(ready=False)
    link, first = served_link("fail-all", Factory(silent, still_silent))
    first.gone = True
    link.begin_step()  # in the step: left to its end
    assert not link.reconnect_idle() and not silent.hello_sent
    link.end_step(None)
    assert not link.reconnect_idle() and link.failures.pending  # no sidecar answers: still lost
    assert silent.closed and still_silent.hello_sent and still_silent.closed  # each tried, then given up


def test_an_idle_reconnect_whose_pending_hello_went_unanswered_tries_a_fresh_one_at_once():
    """A step sent the Hello before the sidecar was up and it never reached it: asked between
    steps (the supervisor knows the sidecar answers), a fresh attempt follows in the same call."""
    silent, fresh = FakeConnection(ready=False), FakeConnection()
    silent.started = time.monotonic()  # within its retry window
    link, first = served_link("fail-all", Factory(silent, fresh))
    first.gone = True
    link.begin_step()
    link.end_step(None)
    run_step(link, [])  # a step's attempt: its Hello unanswered
    assert silent.hello_sent and not silent.closed
    assert link.reconnect_idle() and silent.closed and link.conn is fresh
    assert {e.req_id for e in fresh.sent[-1].failed} == {"plain", "carrier"}


def test_failures_an_idle_reconnect_could_not_send_wait_for_the_next_sidecar():
    broken, fresh = FakeConnection(), FakeConnection()
    broken.fail_send = SidecarError("omni-sidecar closed the connection")
    link, first = served_link("fail-all", Factory(broken, fresh))
    first.gone = True
    link.begin_step()
    link.end_step(None)
    assert not link.reconnect_idle() and broken.closed and link.recovery.state == "lost"
    assert {e.req_id for e in link.failures.pending} == {"plain", "carrier"}
    assert link.reconnect_idle() and {e.req_id for e in fresh.sent[-1].failed} == {"plain", "carrier"}


def test_switch_to_moves_the_session_to_the_successor_at_the_next_step_boundary():
    successor = FakeConnection(endpoint="ipc:///nonexistent/successor.sock")
    factory = Factory(successor)
    link, first = served_link("fail-all", factory)
    first.ack = SwitchAck(endpoint=successor.endpoint, token="resume-1")
    first.results = [StepResult(step=0, switch_to=successor.endpoint,
                                errors=[RequestError("carrier", "hook failed")])]
    link.flush()
    assert link.recovery.state == "switching"
    assert link.failures.request_errors == {"carrier": "hook failed"}
    run_step(link, ["plain", "carrier"])
    assert first.calls == [SwitchReady(last_step=0)] and first.closed
    assert factory.made == [(successor, {"endpoint": successor.endpoint, "resume_token": "resume-1"})]
    assert successor.connected and link.conn is successor
    assert link.recovery.state == "connected" and link.recovery.switches == 1
    assert len(link.recovery.switch_us) == 1 and link.recovery.losses == 0
    assert successor.sent[0].step == 1  # the step that switched went to the successor


def test_an_unsolicited_switch_ack_moves_an_idle_session_without_switch_ready_even_after_the_old_sidecar_exited():
    successor = FakeConnection(endpoint="ipc:///nonexistent/successor.sock")
    factory = Factory(successor)
    link, first = served_link("fail-all", factory)
    # Handed over while idle: no switch_to ever came, and the old sidecar has exited since.
    first.switch_ack = SwitchAck(endpoint=successor.endpoint, token="resume-idle")
    first.gone = True
    run_step(link, ["plain", "carrier"])
    assert first.calls == [] and first.closed  # no SwitchReady round trip to a sidecar that is gone
    assert factory.made == [(successor, {"endpoint": successor.endpoint, "resume_token": "resume-idle"})]
    assert link.conn is successor and link.recovery.state == "connected"
    assert link.recovery.switches == 1 and link.recovery.losses == 0 and not link.failures.request_errors
    assert successor.sent[0].step == 1  # no gap: the next step goes to the successor


def test_a_kept_switch_ack_wins_over_a_pending_switch_ready():
    successor = FakeConnection(endpoint="ipc:///nonexistent/successor.sock")
    link, first = served_link("fail-all", Factory(successor))
    # Busy when the successor asked (switch_to), idle when the old sidecar handed over.
    first.results = [StepResult(step=0, switch_to=successor.endpoint)]
    first.switch_ack = SwitchAck(endpoint=successor.endpoint, token="resume-2")
    first.fail_call = SidecarError("the old sidecar exited")
    run_step(link, ["plain"])
    assert link.conn is successor and link.recovery.switches == 1 and link.recovery.losses == 0


def test_a_session_handed_over_as_its_step_starts_switches_before_that_step_is_sent():
    successor = FakeConnection(endpoint="ipc:///nonexistent/successor.sock")
    factory = Factory(successor)
    link, first = served_link("fail-all", factory)
    # Quiet long enough that the old sidecar handed the session over before reading our StepStart.
    first.ack_at_announce = SwitchAck(endpoint=successor.endpoint, token="resume-race")
    run_step(link, ["plain", "carrier"])
    assert first.announced == [0, 1] and [m.step for m in first.sent] == [0]  # step 1 never went there
    assert factory.made == [(successor, {"endpoint": successor.endpoint, "resume_token": "resume-race"})]
    assert link.conn is successor and successor.announced == [1] and successor.sent[0].step == 1
    assert link.recovery.switches == 1 and link.recovery.losses == 0 and not link.failures.request_errors


def test_an_announced_step_without_a_forward_still_ends_with_a_step_end():
    # vLLM runs finish-only steps (nothing scheduled); the sidecar counted the session as
    # stepping since the StepStart and would never hand it over while idle.
    link, first = served_link("fail-all")
    link.begin_step()
    link.end_step(None)
    assert first.announced == [0, 1] and isinstance(first.sent[-1], StepEnd) and first.sent[-1].step == 1
    assert first.sent[-1].num_tokens == 0 and not first.step_open


def test_a_resume_refused_while_the_address_changed_hands_is_asked_again(monkeypatch):
    # The shim woke up during a later upgrade: the sidecar it reached had just forwarded its
    # state and refused it; the address now names the next sidecar, which holds the state.
    refusing = FakeConnection(endpoint="ipc:///nonexistent/usual.sock")
    refusing.refuse_connect = SidecarError("sidecar is draining; connect to its successor")
    holder = FakeConnection(endpoint="ipc:///nonexistent/usual.sock")
    factory = Factory(refusing, holder)
    link, first = served_link("fail-all", factory)
    sockets = iter([(1, 1), (2, 2), (2, 2)])  # before the first try, after it, before the second
    monkeypatch.setattr(recovery, "socket_identity", lambda endpoint: next(sockets))
    first.switch_ack = SwitchAck(endpoint=holder.endpoint, token="resume-chain")
    run_step(link, ["plain", "carrier"])
    assert [kwargs for _, kwargs in factory.made] == [{"endpoint": holder.endpoint, "resume_token": "resume-chain"}] * 2
    assert link.conn is holder and link.recovery.switches == 1 and link.recovery.losses == 0


def test_an_unanswered_step_start_loses_the_sidecar():
    link, first = served_link("fail-all")
    first.fail_announce = SidecarError("no answer within 1.0s")
    run_step(link, ["plain", "carrier"])
    assert link.conn is None and link.recovery.losses == 1
    assert set(link.failures.request_errors) == {"plain", "carrier"}


def test_a_failed_switch_loses_the_sidecar():
    link, first = served_link("fail-all", Factory())
    first.fail_call = SidecarError("no SwitchAck")
    first.switch_to = "ipc:///nonexistent/successor.sock"  # a result asked for it
    link.begin_step()
    assert link.recovery.state == "lost" and link.recovery.switches == 0 and link.recovery.losses == 1
    assert "switching to the new sidecar" in link.failures.request_errors["plain"]


def test_a_loss_drops_a_switch_the_lost_sidecar_asked_for():
    second = FakeConnection()
    link, first = served_link("fail-all", Factory(second))
    first.switch_to = "ipc:///nonexistent/successor.sock"  # a result asked for it
    link.recovery.lose("test")
    run_step(link, [])
    assert link.conn is second and link.recovery.state == "connected"
    assert second.calls == []  # no SwitchReady to the new sidecar for the old one's successor


@pytest.mark.parametrize("policy", ["fail-all", "fail-payload"])
def test_a_sidecar_that_stays_answers_every_step_with_no_failures(policy):
    link, first = served_link(policy)
    for _ in range(3):
        run_step(link, ["plain", "carrier"])
    assert link.recovery.state == "connected" and link.recovery.losses == 0
    assert [m.step for m in first.sent] == [0, 1, 2, 3]
    assert link.failures.request_errors == {}


def _asking_link() -> tuple[SidecarLink, FakeConnection]:
    first = FakeConnection(needs=HookNeeds(pre_forward="always"))
    link = SidecarLink(Factory(), first)
    link.note_new([request("carrier", True)])
    return link, first


def test_an_early_ask_that_cannot_be_sent_loses_the_sidecar_rather_than_ask_twice():
    """A send that failed may still sit in the transport's queue: asking again in pre_forward could
    send the step's StepBegin twice (its new requests admitted twice, a second plan for the next
    step to take). So the early ask's failure is a loss, as a failed exchange in pre_forward is."""
    link, first = _asking_link()
    first.fail_send = SidecarError("the sidecar did not drain its ring")
    link.begin_step()
    state = step_state(["carrier"])
    link.ask_early(state.input_batch)
    assert link.recovery.losses == 1 and link.conn is None and first.closed
    assert link.pre_forward(state.input_batch, None) == {} and first.calls == []


def test_a_plan_dropped_after_an_upstream_error_still_reports_its_requests_errors():
    from proto.messages import StepPlan

    link, first = _asking_link()
    first.ack = StepPlan(step=0, errors=[RequestError("carrier", "payload: bad codes")])
    link.begin_step()
    link.ask_early(step_state(["carrier"]).input_batch)
    link.abort_step()  # vLLM raised between its batch and its model inputs
    assert link.failures.request_errors == {"carrier": "payload: bad codes"} and link.recovery.losses == 0


def test_a_plan_for_another_step_is_refused():
    from proto.messages import StepBegin, StepPlan
    from proto.packed import packed_layout
    from worker_shim.wire.connection import _plan_of

    ask = StepBegin(step=5, batch=packed_layout(["a"], [0, 1], [3], [3]))
    assert _plan_of(ask, StepPlan(step=5)).step == 5
    with pytest.raises(SidecarError, match="answered step 5 with the plan of step 4"):
        _plan_of(ask, StepPlan(step=4))


def test_a_switch_that_fails_while_a_plan_is_asked_queues_no_new_request_for_the_next_sidecar():
    """The sidecar handed over before it read the step (a SwitchAck, the quiet spell's answer due) and
    the successor refuses the resume: the loss fails the live requests, so their NewRequests must not
    wait for the next sidecar; finish notices stay queued, as every loss keeps them."""
    successor = FakeConnection(endpoint="ipc:///nonexistent/omni-test-successor.sock")
    successor.refuse_connect = SidecarError("refused")
    first = FakeConnection(needs=HookNeeds(pre_forward="always"))
    link = SidecarLink(Factory(successor), first)
    link.note_new([request("carrier", True)])
    link.requests.note_finished(["old"], ())
    link.begin_step()

    def handed_over() -> None:
        raise SidecarError("the sidecar handed this session over to its successor")

    first.switch_ack = SwitchAck(endpoint=successor.endpoint, token="resume-x")
    first.pongs_due = 1
    first.fail_call = SidecarError("the sidecar handed this session over to its successor")
    first.await_pongs = handed_over
    assert link.pre_forward(step_state(["carrier"]).input_batch, None) == {}
    assert link.recovery.losses == 1 and link.conn is None
    assert link.notices.new == [] and link.notices.finished == ["old"]
    assert "carrier" in link.failures.request_errors


def test_a_batch_ended_without_a_sidecar_leaves_the_length_watch_comparing_the_whole_batch_next():
    """Its steady-decode shortcut holds only over steps it saw: one the link ended lost, unseen,
    may have moved rows unevenly (worker_shim/step/finishes.py)."""
    second = FakeConnection()
    first = FakeConnection()
    link = SidecarLink(Factory(second), first)
    reqs = [SimpleNamespace(req_id=r, prompt_token_ids=[1, 2, 3], prompt_len=3,
                            sampling_params=SimpleNamespace(extra_args=None, max_tokens=50)) for r in ("a", "b")]
    link.note_new(reqs)

    def decode_step(computed: int) -> None:
        state = step_state(["a", "b"])
        state.input_batch.num_computed_tokens_np = np.full(2, computed)
        link.begin_step()
        link.end_step(state)

    decode_step(3)
    compares = link.finishes.batch_compares
    decode_step(4)
    assert link.finishes.batch_compares == compares  # steady: no whole-batch comparison
    first.gone = True
    decode_step(5)  # lost at its start: the watch does not see it
    assert link.recovery.losses == 1
    decode_step(6)  # the reconnect's step
    assert link.conn is second
    assert link.finishes.batch_compares == compares + 1
