"""The sidecar daemon as a real process, driven over its socket without vLLM."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import zmq

from omni_sidecar.hook_sets.reference import CaptureHiddenHooks, PromptEmbedsOverlayHooks
from omni_sidecar.hook_api.hook_set import HookErrors, RequestInfo, StepBatch
from omni_sidecar.payload import sidecar_extra_args
from proto.arena import ShmArena
from proto.codec import Codec
from proto.messages import (
    ErrorReply,
    Hello,
    NewRequest,
    Reject,
    StepBegin,
    StepEnd,
    StepPlan,
    StepResult,
    Welcome,
)
from proto.packed import StepLayout, packed_layout
from proto.tensors import TensorRef
from proto.version import PROTOCOL_MAJOR, PROTOCOL_VERSION
from tests.support.procs import SidecarProcess

H = 8


@pytest.fixture
def sidecar(tmp_path, request):
    hooks = getattr(request, "param", "passthrough")
    proc = SidecarProcess(f"ipc://{tmp_path}/s.sock", hooks, tmp_path / "sidecar.log")
    yield proc
    proc.stop()


class Peer:
    def __init__(self, endpoint: str) -> None:
        self.codec = Codec()
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)

    def call(self, msg, raw: bytes | None = None):
        self.sock.send(raw if raw is not None else self.codec.encode(msg))
        assert self.sock.poll(5000), "sidecar did not answer"
        return self.codec.decode(self.sock.recv())

    def close(self):
        self.sock.close(0)


def _hello(arenas, major=PROTOCOL_MAJOR, max_tokens=16):
    return Hello(major, 0, "test", "none", "cpu", 0, 1, "m", H, "float32", max_tokens, arenas)


def test_status_and_ping(sidecar):
    status = sidecar.status()
    assert status.hook_set == "passthrough" and status.sessions == []
    assert status.protocol == PROTOCOL_VERSION


def test_refuses_another_protocol_major(sidecar):
    peer = Peer(sidecar.endpoint)
    reply = peer.call(_hello([], major=PROTOCOL_MAJOR + 1))
    assert isinstance(reply, Reject) and "protocol major version mismatch" in reply.reason
    peer.close()


def test_bad_frames_get_errors_and_the_sidecar_keeps_serving(sidecar):
    peer = Peer(sidecar.endpoint)
    for raw in [b"", b"\xc1", b"\x81\xa4type\xa4nope", b"\x00" * 100]:
        reply = peer.call(None, raw=raw)
        assert isinstance(reply, ErrorReply)
    reply = peer.call(StepEnd(0))
    assert isinstance(reply, ErrorReply) and reply.code == "no_session"
    assert sidecar.status().rejected_frames == 5
    peer.close()


@pytest.mark.parametrize("sidecar", ["capture"], indirect=True)
def test_capture_over_the_wire(sidecar):
    from omni_sidecar.client import RequestFailed, SidecarClient

    arena = ShmArena.create(1 << 16)
    peer = Peer(sidecar.endpoint)
    welcome = peer.call(_hello([arena.info()]))
    assert isinstance(welcome, Welcome) and welcome.needs.hidden_states
    hidden = torch.arange(5 * H, dtype=torch.float32).view(5, H)
    arena.raw(0, hidden.numel() * 4)[:] = hidden.numpy().tobytes()
    layout = packed_layout(["r1-abcdefgh", "r2-abcdefgh"], [0, 3, 5], [0, 0], [3, 2])
    new = [NewRequest("r1-abcdefgh", 3, [1, 2, 3], client_req_id="r1"),
           NewRequest("r2-abcdefgh", 2, [4, 5], client_req_id="r2")]
    result = peer.call(StepEnd(0, layout, new, hidden=TensorRef(0, 0, hidden.numel() * 4, [5, H], "float32"), num_tokens=5))
    assert isinstance(result, StepResult) and result.errors == []
    # An out-of-bounds ref is an error for the step's requests, not a crash.
    bad_layout = packed_layout(["r3-abcdefgh"], [0, 1], [0], [1])
    bad = peer.call(StepEnd(1, bad_layout, [NewRequest("r3-abcdefgh", 1, [9], client_req_id="r3")],
                            hidden=TensorRef(0, 1 << 16, 4 * H, [1, H], "float32"), num_tokens=1))
    assert [e.req_id for e in bad.errors] == ["r3-abcdefgh"] and "outside arena" in bad.errors[0].message
    with SidecarClient(sidecar.endpoint) as client:
        with pytest.raises(RequestFailed, match="outside arena"):
            client.outputs("r3")
        live = client.outputs("r1")  # the client's own id (NewRequest.client_req_id)
        torch.testing.assert_close(live["hidden_states"], hidden[:3])
    peer.call(StepEnd(2, None, [], ["r1-abcdefgh", "r2-abcdefgh"]))
    with SidecarClient(sidecar.endpoint) as client:
        done = client.outputs("r2-abcdefgh", pop=True)
        torch.testing.assert_close(done["hidden_states"], hidden[3:5])
        assert client.outputs("r2-abcdefgh") is None
        (session,) = client.status().sessions
    assert session.finished_requests == 2 and session.steps == 2 and session.errors == 1
    peer.close()
    arena.close()


@pytest.mark.parametrize("sidecar", ["overlay"], indirect=True)
def test_overlay_plan_over_the_wire(sidecar):
    peer = Peer(sidecar.endpoint)
    welcome = peer.call(_hello([]))
    assert welcome.needs.pre_forward == "prefill" and not welcome.needs.prefix_cache_safe
    out = ShmArena.attach(welcome.arenas[0])
    embeds = torch.randn(6, H)
    payload = sidecar_extra_args(prompt_embeds=embeds)["omni_sidecar"]
    # Chunk 2 of a 6-token prompt: 2 tokens done, 3 scheduled -> rows [1, 4) take embeds[2:5].
    layout = packed_layout(["d", "p"], [0, 1, 4], [9, 2], [4, 6])
    plan = peer.call(StepBegin(0, layout, [NewRequest("p", 6, [3] * 6, payload)]))
    assert isinstance(plan, StepPlan) and plan.errors == []
    (ov,) = plan.overlays
    assert ov.row_start == 1
    rows = torch.from_numpy(np.frombuffer(bytes(out.view(ov.rows)), dtype=np.float32).reshape(3, H).copy())
    torch.testing.assert_close(rows, embeds[2:5])
    # A payload whose shape does not match the prompt is a per-request error.
    bad = sidecar_extra_args(prompt_embeds=torch.randn(4, H))["omni_sidecar"]
    plan = peer.call(StepBegin(1, packed_layout(["q"], [0, 5], [0], [5]), [NewRequest("q", 5, [3] * 5, bad)]))
    assert [e.req_id for e in plan.errors] == ["q"] and "does not match" in plan.errors[0].message
    out.close()
    peer.close()


def test_prefill_row_math_is_chunk_aware():
    layout = StepLayout(["dec", "chunk", "last"], [0, 1, 65, 70], [40, 64, 100], [30, 200, 103])
    batch = StepBatch(0, layout, [RequestInfo(r, 0, []) for r in layout.req_ids])
    assert batch.prefill_rows(0) == (0, 0, 40)  # decode: nothing to overlay
    assert batch.prefill_rows(1) == (1, 64, 64)  # a middle chunk: all 64 rows
    assert batch.prefill_rows(2) == (65, 3, 100)  # last chunk with 2 decode-free rows left over


def test_overlay_hook_rejects_bad_payloads_per_request():
    hooks = PromptEmbedsOverlayHooks()
    good = sidecar_extra_args(prompt_embeds=torch.ones(2, 2))["omni_sidecar"]
    with pytest.raises(HookErrors) as e:
        hooks.on_new_requests([
            RequestInfo("x", 2, [1, 2], {"prompt_embeds": {"data": b"123", "shape": [2, 2], "dtype": "float32"}}),
            RequestInfo("ok", 2, [1, 2], good),
            RequestInfo("y", 2, [1, 2], {"prompt_embeds": {"data": b"", "shape": [0], "dtype": "complex7"}}),
        ])
    assert set(e.value.errors) == {"x", "y"}
    assert "need 16" in e.value.errors["x"] and "complex7" in e.value.errors["y"]
    # The good request in the same batch was admitted.
    batch = StepBatch(0, StepLayout(["ok"], [0, 2], [0], [2]), [])
    (row_start, rows), = hooks.prepare_prefill_embeds(batch)
    assert row_start == 0 and torch.equal(rows, torch.ones(2, 2))


def test_capture_hook_forgets_finished_requests():
    hooks = CaptureHiddenHooks()
    hooks.on_new_requests([RequestInfo("a", 2, [1, 2])])
    batch = StepBatch(0, StepLayout(["a"], [0, 2], [0], [2]), [])
    hooks.process_model_output(batch, torch.ones(2, H))
    assert hooks.get_outputs("a")["hidden_states"].shape == (2, H)
    hooks.on_finished(["a"])
    assert hooks.get_outputs("a") is None


class _FailingFinish(CaptureHiddenHooks):
    def on_finished(self, req_ids):
        super().on_finished(req_ids)
        if "bad" in req_ids:
            raise HookErrors({"bad": "could not flush the audio"})
        raise RuntimeError("disk full")


def test_on_finished_errors_fail_the_requests_and_are_counted():
    from omni_sidecar.serve.metrics import SidecarMetrics
    from omni_sidecar.sessions.session import Session
    from omni_sidecar.sessions.store import FinishedOutputs

    store, metrics = FinishedOutputs(10), SidecarMetrics()
    session = Session(1, _hello([]), _FailingFinish(), store, metrics)
    layout = packed_layout(["ok", "bad"], [0, 1, 2], [0, 0], [1, 1])
    session.step_end(StepEnd(0, layout, [NewRequest("ok", 1, [1]), NewRequest("bad", 1, [2], client_req_id="b")]))
    session.step_end(StepEnd(1, None, [], ["bad"]))  # HookErrors: only the named request fails
    assert store.get("b").error == "could not flush the audio" and store.get("bad").outputs is None
    session.step_end(StepEnd(2, None, [], ["ok"]))  # any other exception: every finished request fails
    assert "on_finished: RuntimeError('disk full')" in store.get("ok").error
    assert session.errors == 2 and metrics.request_errors._value.get() == 2
    session.close()


def test_prometheus_metrics(tmp_path):
    import socket
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = SidecarProcess(f"ipc://{tmp_path}/m.sock", "capture", tmp_path / "sidecar.log",
                          extra_args=["--metrics-port", str(port)])
    try:
        arena = ShmArena.create(1 << 16)
        peer = Peer(proc.endpoint)
        peer.call(_hello([arena.info()]))
        layout = packed_layout(["a"], [0, 2], [0], [2])
        peer.call(StepEnd(0, layout, [NewRequest("a", 2, [1, 2])], hidden=TensorRef(0, 0, 2 * H * 4, [2, H], "float32"),
                          num_tokens=2, shim_exchange_us=80.0, shim_post_us=40.0))
        peer.call(StepEnd(1, layout, hidden=TensorRef(0, 0, H * 4, [1, H], "float32"), num_tokens=1))
        peer.call(None, raw=b"\xc1")
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        peer.close()
        arena.close()
    finally:
        proc.stop()
    metrics = {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines()
               if line and not line.startswith("#")}
    assert metrics["omni_sidecar_steps_total"] == 2
    assert metrics["omni_sidecar_scheduled_tokens_total"] == 3
    assert metrics['omni_sidecar_requests_total{event="new"}'] == 1
    assert metrics["omni_sidecar_step_hook_seconds_count"] == 2
    assert metrics["omni_sidecar_shim_exchange_seconds_count"] == 1
    assert metrics["omni_sidecar_shim_exchange_seconds_sum"] == pytest.approx(80e-6)
    assert metrics['omni_sidecar_rejected_frames_total{code="malformed_frame"}'] == 1
    assert metrics["omni_sidecar_sessions"] == 1
    assert metrics['omni_sidecar_arena_bytes{direction="shim_to_sidecar"}'] == 1 << 16
    assert metrics['omni_sidecar_arena_used_bytes{direction="shim_to_sidecar"}'] == H * 4


def test_a_busy_ring_turn_serves_every_socket_message_waiting_not_one():
    """While a shim's ring keeps the loop busy, the socket is asked every SOCKET_CHECK_S; what waits
    there then (a front end's outputs queries, one per stream) is served in that turn, up to
    SOCKET_BURST, instead of one a turn behind a step each."""
    import time
    from types import SimpleNamespace

    from omni_sidecar.serve.server import SOCKET_BURST, SidecarServer
    from proto.transport import SpinWindow

    queued = [[b"c%d" % i, b"q"] for i in range(SOCKET_BURST + 5)]
    served = []
    server = SidecarServer.__new__(SidecarServer)
    server.listener = SimpleNamespace(readable=lambda: bool(queued), recv_frames=lambda: queued.pop(0))
    server._serve = served.append
    server.peers = SimpleNamespace(pump=lambda dispatch: True,  # the ring always has a step message
                                   serve_hot=lambda *a, **k: time.monotonic())
    server._dispatch = lambda *a: None
    server._socket_due = 0.0
    server._busy_at = time.monotonic()
    server.spin = SpinWindow(10_000_000, 0)
    server.wait = SimpleNamespace(spin=lambda *a: True)
    server._serve_rings_once()
    assert [f[0] for f in served] == [b"c%d" % i for i in range(SOCKET_BURST)]
    assert len(queued) == 5  # the rest next time the socket is due: the rings are not held off longer


def test_the_sidecars_hot_ring_loop_hands_back_at_its_deadline_when_the_ring_never_runs_dry():
    """A shim that keeps its ring full must not hold off the server loop's housekeeping (the socket,
    reaping, other sessions): `serve_hot` returns once `until` passes even when every turn serves."""
    import time
    from types import SimpleNamespace

    from omni_sidecar.serve.peers import PeerTable
    from proto.transport import SpinWindow

    table = PeerTable.__new__(PeerTable)
    t0 = time.monotonic()
    rx = SimpleNamespace(has_data=lambda: time.monotonic() < t0 + 1.0)  # one more message for a second
    peer = SimpleNamespace(ident=b"p", rings=SimpleNamespace(closed=False, queued=False, duplex=SimpleNamespace(rx=rx)))
    table._peers = {b"p": peer}
    served = []
    table.serve_one = lambda p, dispatch: served.append(1) or True
    table.serve_hot(lambda *a: None, until=t0 + 0.02, busy_at=t0, spin=SpinWindow(10_000_000, 0),
                    loop_wanted=lambda: False)
    assert time.monotonic() - t0 < 0.5 and len(served) > 0
