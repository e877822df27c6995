"""The CLI as a user meets it: every user error is one clear line and exit status 2."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from proto.arena import ShmArena
from proto.messages import BatchLayout, NewRequest, StepEnd, StepResult, Welcome
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


def test_unknown_and_failed_requests_are_one_line(capture_sidecar):
    endpoint = capture_sidecar.endpoint
    arena = ShmArena.create(1 << 16)
    peer = Peer(endpoint)
    try:
        assert isinstance(peer.call(_hello([arena.info()])), Welcome)
        hidden = torch.ones(1, H)
        arena.raw(0, hidden.numel() * 4)[:] = hidden.numpy().tobytes()
        # A ref outside the arena fails request "bad" (the hooks' error), "good" succeeds.
        layout = BatchLayout(["bad"], [0, 1], [0], [1])
        result = peer.call(StepEnd(0, layout, [NewRequest("bad", 1, [9])],
                                   hidden=TensorRef(0, 1 << 16, 4 * H, [1, H], "float32"), num_tokens=1))
        assert isinstance(result, StepResult) and result.errors
        peer.call(StepEnd(1, None, [], ["bad"]))
        failed = _one_clear_line(_cli("outputs", "bad", "--endpoint", endpoint), "bad", "failed")
        assert "outside arena" in failed
        _one_clear_line(_cli("outputs", "never-seen", "--endpoint", endpoint), "never-seen")
        ok = _cli("status", "--endpoint", endpoint)
        assert ok.returncode == 0 and '"hook_set": "capture"' in ok.stdout
    finally:
        peer.close()
        arena.close()
