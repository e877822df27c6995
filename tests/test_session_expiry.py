"""Sessions of shims that go away end, whatever PID namespace the shim lives in.

The sidecar cannot see a process in another namespace (two containers); it sees
the connection close. These shims claim a pid in a foreign namespace, so the
pid reaper cannot help: only the connection can end their sessions.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from omni_sidecar.client import RequestFailed, SidecarClient
from proto.arena import ShmArena
from proto.codec import Codec
from proto.messages import Hello, NewRequest, StepEnd, StepResult, Welcome
from proto.packed import packed_layout
from proto.version import PROTOCOL_MAJOR
from tests.support.procs import SidecarProcess, child_env

FOREIGN = dict(pid=4242, pid_namespace="pid:[1]")  # not ours: process_gone() cannot decide


@pytest.fixture
def sidecar(tmp_path):
    proc = SidecarProcess(f"ipc://{tmp_path}/s.sock", "capture", tmp_path / "sidecar.log")
    yield proc
    proc.stop()


SHIM = textwrap.dedent("""
    import sys, zmq
    from proto.arena import ShmArena
    from proto.codec import Codec
    from proto.messages import Hello, NewRequest, StepEnd
    from proto.packed import packed_layout
    from proto.version import PROTOCOL_MAJOR
    arena = ShmArena.create(1 << 16)
    codec = Codec()
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.connect(sys.argv[1])
    sock.send(codec.encode(Hello(PROTOCOL_MAJOR, 0, "t", "none", "cpu", 0, 1, "m", 8, "float32", 16, [arena.info()],
                                 pid=4242, pid_namespace="pid:[1]")))
    assert sock.poll(10000)
    sock.recv()
    sock.send(codec.encode(StepEnd(0, packed_layout(["live-1"], [0, 1], [0], [1]),
                                   [NewRequest("live-1", 1, [3])], num_tokens=1)))
    assert sock.poll(10000)
    sock.recv()
    print("ready", flush=True)
    sys.stdin.read()  # hold the connection until killed or stopped
""")


def _session_count(sidecar) -> int:
    return len(sidecar.status().sessions)


def _wait_sessions(sidecar, want: int, timeout_s: float) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if _session_count(sidecar) == want:
            return time.monotonic() - t0
        time.sleep(0.05)
    raise AssertionError(f"still {_session_count(sidecar)} session(s) after {timeout_s} s")


def test_a_closed_connection_ends_the_session_and_fails_its_live_requests(sidecar):
    arena = ShmArena.create(1 << 16)
    codec = Codec()
    import zmq

    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(sidecar.endpoint)
    try:
        sock.send(codec.encode(Hello(PROTOCOL_MAJOR, 0, "t", "none", "cpu", 0, 1, "m", 8, "float32", 16, [arena.info()], **FOREIGN)))
        assert sock.poll(10000) and isinstance(codec.decode(sock.recv()), Welcome)
        sock.send(codec.encode(StepEnd(0, packed_layout(["live-1"], [0, 1], [0], [1]), [NewRequest("live-1", 1, [3])],
                                       num_tokens=1)))
        assert sock.poll(10000) and isinstance(codec.decode(sock.recv()), StepResult)
        assert _session_count(sidecar) == 1
    finally:
        sock.close(0)
        arena.close()
    _wait_sessions(sidecar, 0, timeout_s=5)
    with SidecarClient(sidecar.endpoint) as client, pytest.raises(RequestFailed, match="connection"):
        client.outputs("live-1")


@pytest.mark.parametrize("how", ["kill", "stop"])
def test_a_vanished_or_frozen_shim_process_is_expired_by_heartbeat(sidecar, how):
    proc = subprocess.Popen([sys.executable, "-c", SHIM, sidecar.endpoint], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, env=child_env())
    try:
        assert proc.stdout.readline().strip() == b"ready"
        assert _session_count(sidecar) == 1
        os.kill(proc.pid, signal.SIGKILL if how == "kill" else signal.SIGSTOP)
        # kill: the kernel closes the connection at once; stop: no heartbeat answers for
        # HEARTBEAT_TIMEOUT_MS (3 s), then libzmq closes it.
        _wait_sessions(sidecar, 0, timeout_s=10)
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        for name in os.listdir("/dev/shm"):  # the killed shim's arena (its creator is gone)
            if name.startswith(f"omni-sidecar-{proc.pid}-"):
                os.unlink(os.path.join("/dev/shm", name))
    with SidecarClient(sidecar.endpoint) as client, pytest.raises(RequestFailed, match="connection"):
        client.outputs("live-1")
