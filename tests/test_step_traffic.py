"""What a step puts on the wire and how often it waits: structure, never timing.

The shim's real link, connection and rings against a real sidecar process (vLLM's batch faked):
- a pass-through step (hooks that read nothing per step) sends its StepStart and one fixed-size
  record, the same bytes for 1 request as for 256, and kicks nobody awake;
- no step waits for the sidecar more than once: not a steady step, not the first step after a
  quiet spell (whose StepStart asks for an answer), not one that also asks for a plan.
See docs/ARCHITECTURE.md, Step sequence.
"""

from __future__ import annotations

import os
import time
from types import SimpleNamespace

import msgspec
import pytest

from proto.codec import Codec
from proto.messages import Hello, StepStart
from proto.settings import STEP_START_ANSWER_S
from proto.version import PROTOCOL_MAJOR, PROTOCOL_MINOR
from bench.step_cost import decode_state
from tests.support.procs import SidecarProcess

MINIMAL_RECORD_BYTES = 128  # a step-end record with scalars only; a layout of 256 rows is ~1 KiB


def _request(req_id: str) -> SimpleNamespace:
    return SimpleNamespace(req_id=req_id, prompt_token_ids=[1, 2, 3], prompt_len=3,
                           sampling_params=SimpleNamespace(extra_args=None))



class RecordedLink:
    """A SidecarLink whose channel records, per step, each frame it sends, each kick and each wait."""

    def __init__(self, endpoint: str) -> None:
        from worker_shim.config import RingConfig
        from worker_shim.wire.connection import SidecarConnection
        from worker_shim.step.link import SidecarLink

        hello = Hello(PROTOCOL_MAJOR, PROTOCOL_MINOR, "test", "none", "cpu", 0, 1, "m", 8, "float32", 1024, [],
                      pid=os.getpid())

        def connect(endpoint: str = endpoint, resume_token: str = "") -> SidecarConnection:
            return SidecarConnection(endpoint, 10.0, msgspec.structs.replace(hello, resume_token=resume_token),
                                     1 << 16, 2, arena_prefix="omni-test-traffic", ring=RingConfig())

        conn = connect()
        conn.connect(10.0)
        self.link = SidecarLink(connect, conn, length_finishes=False)
        self.frames: list[bytes] = []
        self.waits = 0
        channel = conn.channel
        assert channel.rings is not None, "the sidecar did not accept the rings"
        encode = channel.codec.encode

        def recording_encode(msg):
            frame = encode(msg)
            self.frames.append(frame)
            return frame

        def counting(method, must_wait):
            """One of the channel's ways to wait for a reply: counts once when it has to wait."""
            def wrapped(*args, **kwargs):
                self.waits += must_wait(*args, **kwargs)
                return method(*args, **kwargs)
            return wrapped

        channel.codec.encode = recording_encode
        channel.answer = counting(channel.answer, lambda msg, want: True)  # `call` waits through it too
        channel.take_results = counting(
            channel.take_results, lambda until_step=None: until_step is not None and channel.acked_step < until_step)
        channel.await_pongs = counting(channel.await_pongs, lambda: channel.pongs_due > 0)  # a quiet spell's StepStart answer
        self.kicks = lambda: channel.kicks_sent

    def step(self, state, pre_forward: bool = True, early: bool = False) -> tuple[list[bytes], int, int]:
        """One step as the runner drives it: (frames sent, kicks, waits); `early`: the StepBegin asked
        when vLLM's batch is built (the runner's prepare_inputs), the plan taken in pre_forward."""
        self.frames.clear()
        self.waits = 0
        kicks = self.kicks()
        self.link.note_finished(set(), None)
        self.link.begin_step()
        if early:
            self.link.ask_early(state.input_batch)
            self.sent_early = len(self.frames)
        if pre_forward:
            self.link.pre_forward(state.input_batch, None)
        self.link.end_step(state)
        return list(self.frames), self.kicks() - kicks, self.waits


@pytest.fixture
def sidecar(tmp_path, request):
    proc = SidecarProcess(f"ipc://{tmp_path}/sc.sock", request.param, tmp_path / "sidecar.log")
    yield proc
    proc.stop()


@pytest.mark.parametrize("sidecar", ["passthrough"], indirect=True)
def test_a_pass_through_step_sends_one_fixed_size_record_and_wakes_nobody(sidecar, monkeypatch):
    from worker_shim.session import recovery

    monkeypatch.setattr(recovery, "STEP_START_ANSWER_S", 3600.0)  # a stalled test host asks no answers here
    shim = RecordedLink(sidecar.endpoint)
    codec = Codec()
    try:
        records: dict[int, set[bytes]] = {}
        step = 0
        for n in (1, 256):
            req_ids = [f"cmpl-{n}-{i:04d}-abcdef12" for i in range(n)]
            shim.link.note_new([_request(r) for r in req_ids])
            shim.step(decode_state(req_ids, step))  # this step brings requests: a full StepEnd
            step += 1
            for _ in range(5):
                frames, kicks, waits = shim.step(decode_state(req_ids, step))
                step += 1
                assert len(frames) == 2, [codec.decode(f) for f in frames]
                start, end = frames
                assert isinstance(codec.decode(start), StepStart)
                assert len(end) <= MINIMAL_RECORD_BYTES, (len(end), codec.decode(end))
                assert kicks == 0 and waits == 0
                # Scalars only: everything but the step number and timings is the same for every step.
                ended = msgspec.structs.asdict(codec.decode(end))
                records.setdefault(n, set()).add(msgspec.json.encode({k: v for k, v in ended.items()
                                                                      if k not in ("step", "num_tokens")
                                                                      and not k.endswith("_us")}))
            shim.link.note_finished(set(req_ids), None)
        assert records[1] == records[256], records  # the record does not grow with the batch
        shim.link.begin_step()
        shim.link.end_step(None)
        stats = shim.link.stats()  # waits until the sidecar read every step
        session = sidecar.status().sessions[0]
        assert session.steps == stats["steps"] == 12
        assert session.scheduled_tokens == stats["scheduled_tokens"] == 6 * 1 + 6 * 256
        assert session.new_requests == 257 and session.finished_requests == 257
        # Only the steps that brought requests or finishes sent a StepEnd (the last one: the finishes alone),
        # each timed in CPU; no tick read the thread's clock.
        assert len(stats["step_end_cpu_us"]) == 3 and stats["plan_read_cpu_us"] == []
    finally:
        shim.link.close()


def test_the_worker_threads_cpu_time_is_recorded_for_each_plan_read_and_step_end(tmp_path):
    """The omni set through a real sidecar: every step reads a plan and sends a StepEnd; each records
    the worker thread's CPU time beside the wall time, so bench.gpu can tell the shim's own work in
    them from waiting (the GIL, a core) inside the engine."""
    from bench.step_cost import ShimUnderTest

    shim = None
    try:
        shim = ShimUnderTest(tmp_path, "omni", "omni", 8)
        shim.run(30, 0.0, True)
        stats = shim.link.stats()
    finally:
        if shim is not None:
            shim.close()
    assert stats["blocking_exchanges"] == stats["steps"] == 30
    assert len(stats["plan_read_cpu_us"]) == len(stats["plan_read_us"]) == 30
    assert len(stats["step_end_cpu_us"]) == len(stats["post_us"]) == 30
    assert sum(stats["plan_read_cpu_us"]) > 0 and sum(stats["step_end_cpu_us"]) > 0  # read from the clock


@pytest.mark.parametrize("early", [False, True], ids=["asked-in-pre-forward", "asked-early"])
@pytest.mark.parametrize("sidecar", ["passthrough", "tests.support.asking_hooks:AskEveryStepHooks"],
                         indirect=True)
def test_no_step_waits_for_the_sidecar_more_than_once(sidecar, early):
    shim = RecordedLink(sidecar.endpoint)
    asks = shim.link.needs.pre_forward == "always"
    try:
        req_ids = [f"cmpl-{i:04d}-abcdef12" for i in range(8)]
        shim.link.note_new([_request(r) for r in req_ids])
        waits = []
        for step in range(40):
            if step % 10 == 9:
                time.sleep(2 * STEP_START_ANSWER_S)  # a quiet spell: this StepStart asks for an answer
            frames, _, wait = shim.step(decode_state(req_ids, step), early=early)
            waits.append(wait)
            if early and asks:  # the StepBegin went when the batch was built; pre_forward sent nothing
                kinds = [type(Codec().decode(f)).__name__ for f in frames]
                assert kinds[shim.sent_early - 1] == "StepBegin" and "StepBegin" not in kinds[shim.sent_early:], kinds
        assert max(waits) <= 1, waits
        if asks:  # every step asks for its plan: one wait each, the quiet spell's answer included
            assert waits == [1] * 40, waits
        else:  # the quiet spells' answers (a step after a stall of the test host may ask one too)
            assert [waits[s] for s in range(9, 40, 10)] == [1] * 4, waits
        assert shim.link.stats()["losses"] == 0
    finally:
        shim.link.close()


@pytest.mark.parametrize("sidecar", ["bench.step_cost_hooks:ObservingPassThrough"], indirect=True)
def test_hooks_that_read_every_layout_get_it_packed(sidecar):
    """A steady step's StepEnd carries its layout as packed u32 columns (4 bytes a row), no lists;
    the request ids only when they changed. The sidecar counts every step."""
    shim = RecordedLink(sidecar.endpoint)
    codec = Codec()
    try:
        req_ids = [f"cmpl-{i:04d}-abcdef12" for i in range(64)]
        shim.link.note_new([_request(r) for r in req_ids])
        frames, _, _ = shim.step(decode_state(req_ids, 0))
        first = codec.decode(frames[-1])
        assert first.batch.req_ids == req_ids
        sizes = set()
        for step in range(1, 6):
            frames, _, waits = shim.step(decode_state(req_ids, step))
            end = codec.decode(frames[-1])
            assert end.batch.req_ids is None and waits == 0
            assert len(end.batch.num_computed_tokens) == 4 * 64
            sizes.add(len(frames[-1]))
        assert len(sizes) == 1, sizes  # the same bytes each step: nothing grows with the values
        stats = shim.link.stats()
        assert sidecar.status().sessions[0].steps == stats["steps"] == 6 and stats["losses"] == 0
    finally:
        shim.link.close()


@pytest.mark.parametrize("sidecar", ["tests.support.asking_hooks:AskEveryStepHooks"], indirect=True)
def test_a_step_that_fails_after_its_early_ask_leaves_no_plan_for_the_next(sidecar):
    """Upstream raises between the early StepBegin and the plan's read (abort_step): the plan is taken
    and dropped, so the next step's plan is its own (a stale one would be accepted as the answer)."""
    shim = RecordedLink(sidecar.endpoint)
    conn = shim.link.conn
    taken = []
    take_plan = conn.take_plan
    def recording(msg):
        plan = take_plan(msg)
        taken.append((msg.step, plan.step))
        return plan

    conn.take_plan = recording
    try:
        req_ids = [f"cmpl-{i:04d}-abcdef12" for i in range(4)]
        shim.link.note_new([_request(r) for r in req_ids])
        shim.link.begin_step()
        shim.link.ask_early(decode_state(req_ids, 0).input_batch)
        shim.link.abort_step()  # vLLM raised before its model inputs were prepared
        conn.take_plan = take_plan
        plans = []
        for step in (1, 2):
            state = decode_state(req_ids, step)
            shim.link.begin_step()
            shim.link.ask_early(state.input_batch)
            early = shim.link._early
            assert early is not None and early.msg.step == shim.link.step
            plans.append(conn.take_plan(early.msg).step)  # what pre_forward would take
            shim.link._early = None
            shim.link.end_step(state)
        assert taken == [(0, 0)] and plans == [0, 1], (taken, plans)  # an aborted step keeps its number
        # A plan left unread would be the answer the flush's Ping met first: a loss.
        assert shim.link.stats()["losses"] == 0
    finally:
        shim.link.close()
