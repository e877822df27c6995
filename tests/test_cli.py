"""The CLI as a user meets it: every user error is one clear line and exit status 2."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from proto.arena import ShmArena
from proto.messages import NewRequest, StepEnd, StepResult, Welcome
from proto.packed import packed_layout
from proto.tensors import TensorRef
from tests.support.procs import SidecarProcess, child_env
from tests.test_sidecar import H, Peer, _hello


def _cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "omni_sidecar.cli", *args], capture_output=True,
                          text=True, timeout=timeout, env=child_env())


def _one_clear_line(proc: subprocess.CompletedProcess, *words: str) -> str:
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out
    assert "Traceback" not in out, out
    lines = [line for line in out.splitlines() if line.strip()]
    assert len(lines) == 1, out
    for word in words:
        assert word in lines[0], out
    return lines[0]


@pytest.mark.parametrize("args, words", [
    (["status", "--endpoint", "foo"], ["'foo'", "ipc://"]),
    (["status", "--endpoint", "ipc:///nonexistent/dir/s.sock"], ["does not exist", "omni-sidecar serve"]),
    (["outputs", "r1", "--endpoint", "ipc:///nonexistent/dir/s.sock"], ["does not exist"]),
    (["upgrade", "--endpoint", "ipc:///nonexistent/dir/s.sock"], ["does not exist"]),
])
def test_no_sidecar_or_bad_endpoint_is_one_line(args, words):
    _one_clear_line(_cli(*args), *words)


@pytest.fixture
def capture_sidecar(tmp_path):
    proc = SidecarProcess(f"ipc://{tmp_path}/s.sock", "capture", tmp_path / "sidecar.log")
    yield proc
    proc.stop()


def test_unknown_and_failed_requests_are_one_line(capture_sidecar, tmp_path):
    endpoint = capture_sidecar.endpoint
    arena = ShmArena.create(1 << 16)
    peer = Peer(endpoint)
    try:
        assert isinstance(peer.call(_hello([arena.info()])), Welcome)
        hidden = torch.ones(1, H)
        arena.raw(0, hidden.numel() * 4)[:] = hidden.numpy().tobytes()
        # A ref outside the arena fails request "bad" (the hooks' error), "good" succeeds.
        layout = packed_layout(["bad"], [0, 1], [0], [1])
        result = peer.call(StepEnd(0, layout, [NewRequest("bad", 1, [9])],
                                   hidden=TensorRef(0, 1 << 16, 4 * H, [1, H], "float32"), num_tokens=1))
        assert isinstance(result, StepResult) and result.errors
        peer.call(StepEnd(1, None, [], ["bad"]))
        failed = _one_clear_line(_cli("outputs", "bad", "--endpoint", endpoint), "bad", "failed")
        assert "outside arena" in failed
        _one_clear_line(_cli("outputs", "never-seen", "--endpoint", endpoint), "never-seen")
        payload = tmp_path / "append.msgpack"
        payload.write_bytes(b"\x81\xa7entries\x80")  # {"entries": {}}
        gone = _one_clear_line(_cli("append", "never-seen", str(payload), "--endpoint", endpoint), "unknown_request")
        assert "'never-seen' is not running" in gone
        _one_clear_line(_cli("append", "r", str(tmp_path / "missing"), "--endpoint", endpoint), "No such file")
        ok = _cli("status", "--endpoint", endpoint)
        assert ok.returncode == 0 and '"hook_set": "capture"' in ok.stdout
    finally:
        peer.close()
        arena.close()


def test_a_flood_of_hostile_frames_gives_a_bounded_log(tmp_path):
    """20,000 rejected frames from one peer (and a few from 20 others): every frame counted,
    the log holds at most a first line and a summary per peer."""
    import time

    import zmq

    log_path = tmp_path / "sidecar.log"
    sidecar = SidecarProcess(f"ipc://{tmp_path}/s.sock", "passthrough", log_path)
    socks = []
    try:
        ctx = zmq.Context.instance()
        flood = ctx.socket(zmq.DEALER)
        flood.setsockopt(zmq.LINGER, 0)
        flood.connect(sidecar.endpoint)
        socks.append(flood)
        for i in range(20_000):
            flood.send(b"\xc1garbage-%d" % i)
            if i % 500 == 0:  # keep our receive queue short; the replies are ErrorReplies
                while flood.poll(0):
                    flood.recv()
        for _ in range(20):
            other = ctx.socket(zmq.DEALER)
            other.setsockopt(zmq.LINGER, 0)
            other.connect(sidecar.endpoint)
            socks.append(other)
            for _ in range(10):
                other.send(b"\xc1")
        deadline = time.monotonic() + 60
        while sidecar.status().rejected_frames < 20_200 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert sidecar.status().rejected_frames == 20_200
    finally:
        for sock in socks:
            sock.close(0)
        sidecar.stop()
    lines = [line for line in log_path.read_text().splitlines() if "rejected" in line]
    assert 21 <= len(lines) <= 2 * 21, f"{len(lines)} log lines about rejected frames"
