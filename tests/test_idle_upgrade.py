"""Hot upgrades that complete while vLLM is idle (docs/ARCHITECTURE.md, Hot upgrade).

The rule on the sidecar's side with real sidecar processes and a shim speaking the protocol by
hand; then a real vLLM V2 engine with the shim, real sidecars, the `omni-sidecar upgrade` command.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import msgspec
import numpy as np
import pytest
import zmq

from proto.arena import ShmArena
from proto.codec import Codec
from proto.messages import Hello, StepEnd, StepResult, StepStart, SwitchAck, Welcome
from proto.settings import IDLE_HANDOVER_S
from proto.version import PROTOCOL_MAJOR, PROTOCOL_MINOR
from tests.support.procs import ROOT, SidecarProcess, child_env


def test_the_status_and_upgrade_commands_start_without_torch():
    # The upgrade command's own start-up is on every upgrade's path: torch alone takes seconds.
    code = ("import sys; from omni_sidecar import cli; cli._parser(); from omni_sidecar import client; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=child_env(), check=True)
    assert out.stdout.strip() == "[]", out.stdout


class HandShim:
    """A shim on the socket alone (no rings), spoken by hand."""

    def __init__(self, endpoint: str, arena: ShmArena, resume_token: str = "") -> None:
        self.codec = Codec()
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        hello = Hello(PROTOCOL_MAJOR, PROTOCOL_MINOR, "test", "none", "cpu", 0, 1, "m", 8, "float32", 16,
                      [arena.info()], resume_token=resume_token, pid=os.getpid())
        self.send(hello)
        self.welcome = self.recv(10.0)

    def send(self, msg) -> None:
        self.sock.send(self.codec.encode(msg))

    def recv(self, timeout_s: float):
        assert self.sock.poll(int(timeout_s * 1000)), "the sidecar sent nothing"
        return self.codec.decode(self.sock.recv())

    def close(self) -> None:
        self.sock.close(0)


def _wait_for_line(path, text: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while text not in path.read_text():
        assert time.monotonic() < deadline, f"no {text!r} in {path}:\n{path.read_text()}"
        time.sleep(0.05)


def _stop_sidecars(endpoint: str, first: SidecarProcess) -> None:
    """Stop the sidecar serving at `endpoint` (the last upgrade's, not our child) and the first one."""
    from omni_sidecar.client import SidecarClient, SidecarUnavailable

    try:
        with SidecarClient(endpoint) as client:
            last = client.status().pid
        if last != first.proc.pid:
            _stop_pid(last)
    except SidecarUnavailable:
        pass
    first.stop()


def _spare_leaves(endpoint: str, timeout_s: float = 15.0) -> None:
    """Once no sidecar serves at `endpoint`, its warm spare leaves (socket file and process); if
    it does not, fail, after killing every process still running for that endpoint."""
    from proto.endpoint import ipc_path

    path = ipc_path(endpoint)
    deadline = time.monotonic() + timeout_s
    while os.path.exists(f"{path}.spare") and time.monotonic() < deadline:
        time.sleep(0.1)
    if os.path.exists(f"{path}.spare"):
        stray = _kill_processes_naming(path)
        pytest.fail(f"the warm spare did not leave within {timeout_s:.0f} s of the last sidecar's stop; "
                    f"killed what still ran for {endpoint}: {stray}")


def _kill_processes_naming(text: str) -> list[str]:
    """SIGKILL our processes whose command line holds `text` (a spare and the sidecars it forked keep
    the spare's command line); their command lines."""
    killed = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
            if text in cmdline:
                os.kill(int(entry), signal.SIGKILL)
                killed.append(f"{entry}: {cmdline}")
        except (OSError, ProcessLookupError):
            pass
    return killed


def _logs(directory, chars: int = 1500) -> str:
    """The end of every sidecar log in `directory`, for a failure's message."""
    return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-chars:]}" for p in sorted(directory.glob("*.log")))


def _stop_pid(pid: int) -> None:
    """SIGTERM a sidecar this test started through `upgrade` (not our child) and wait until it is gone."""
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)


def test_a_session_goes_to_the_successor_between_its_steps_never_inside_one(tmp_path):
    from omni_sidecar.client import SidecarClient

    endpoint = f"ipc://{tmp_path}/sc.sock"
    first = SidecarProcess(endpoint, "passthrough", tmp_path / "first.log")
    arenas = [ShmArena.create(1 << 16), ShmArena.create(1 << 16)]  # a new one per connection
    shims: list[HandShim] = []
    upgrade = None
    try:
        shim = HandShim(endpoint, arenas[0])
        shims.append(shim)
        assert isinstance(shim.welcome, Welcome)
        shim.send(StepStart(step=0))  # a step begins; its forward may take long and sends nothing
        upgrade = subprocess.Popen(
            [sys.executable, "-m", "omni_sidecar.cli", "upgrade", "--endpoint", endpoint, "--timeout", "60",
             "--", "--hooks", "passthrough"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=child_env(),
        )
        _wait_for_line(first.log_path, "takeover accepted", 60)
        # Inside a step nothing moves, however long the step lasts.
        assert not shim.sock.poll(int(4 * IDLE_HANDOVER_S * 1000))
        assert upgrade.poll() is None
        shim.send(StepEnd(step=0))
        result = shim.recv(10.0)
        assert isinstance(result, StepResult) and result.switch_to
        # Between steps: handed over unasked (an idle engine may not step for hours).
        ack = shim.recv(10.0)
        assert isinstance(ack, SwitchAck) and ack.endpoint == endpoint and ack.token
        out, _ = upgrade.communicate(timeout=30)
        assert upgrade.returncode == 0, out
        with SidecarClient(endpoint) as client:
            successor_pid = client.status().pid
        assert successor_pid not in (0, first.proc.pid)
        # The usual address is the successor's: the shim resumes its session there.
        resumed = HandShim(endpoint, arenas[1], resume_token=ack.token)
        shims.append(resumed)
        assert isinstance(resumed.welcome, Welcome)
        resumed.send(StepStart(step=1, answer=True))
        assert resumed.recv(10.0).nonce == 1
        with SidecarClient(endpoint) as client:
            assert len(client.status().sessions) == 1
        assert first.proc.wait(15) == 0  # the old one drained and exited
    finally:
        if upgrade is not None and upgrade.poll() is None:
            upgrade.kill()
            upgrade.wait()
        for s in shims:
            s.close()
        _stop_sidecars(endpoint, first)
        for arena in arenas:
            arena.close()


FRESH_HOOKS = """
from omni_sidecar.hook_sets.reference import PassThroughHooks


class Fresh(PassThroughHooks):
    name = {name!r}
"""


def test_the_warm_spare_forks_new_sidecars_that_run_the_code_on_disk(tmp_path):
    from omni_sidecar.client import SidecarClient
    from omni_sidecar.upgrade.spare import fork_sidecar

    endpoint = f"ipc://{tmp_path}/sc.sock"
    assert fork_sidecar(endpoint, ["status"], str(tmp_path / "x.log")) is None  # no spare: a cold start
    first = SidecarProcess(endpoint, "passthrough", tmp_path / "first.log", extra_args=["--warm-spare"])
    spare = tmp_path / "sc.sock.spare"
    hooks_file = tmp_path / "fresh_hooks.py"
    env = child_env(PYTHONPATH=f"{tmp_path}{os.pathsep}{ROOT}")  # the hook module lives with the asker only
    last_pid = 0
    try:
        _wait_for(spare.exists, 120)
        assert spare.stat().st_mode & 0o077 == 0
        for name in ("fresh-1", "fresh-2"):  # the second one edits the module the first imported
            hooks_file.write_text(FRESH_HOOKS.format(name=name))
            out = subprocess.run(
                [sys.executable, "-m", "omni_sidecar.cli", "upgrade", "--endpoint", endpoint, "--timeout", "60",
                 "--", "--hooks", "fresh_hooks:Fresh"],
                capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120,
            )
            assert out.returncode == 0 and "forked by the warm spare" in out.stdout, out.stdout + out.stderr
            with SidecarClient(endpoint) as client:
                status = client.status()
            assert status.hook_set == name and status.pid != last_pid
            last_pid = status.pid
    finally:
        _stop_sidecars(endpoint, first)
        _spare_leaves(endpoint)  # no sidecar serves there: the spare leaves


LAST_FRAME_JOB = """
import os, sys
from omni_sidecar.serve.listener import Listener
listener = Listener(1 << 30, [], None)
listener.bind(sys.argv[1])
frames = listener.recv_frames()  # the asker's hello
listener.send(frames[0], bytes(range(256)) * (int(sys.argv[2]) // 256))
listener.close()
listener.flush()
os._exit(0)  # as a sidecar the warm spare forked ends: no interpreter clean-up
"""


def test_a_frame_sent_just_before_a_sidecar_exits_still_leaves(tmp_path):
    # The successor's state is the last thing an old sidecar sends before it exits, at once when
    # its sessions are gone; ZeroMQ drops queued frames of a process that exits without
    # terminating its context (without flush() this frame was lost in 20 of 20 tries).
    endpoint, size = f"ipc://{tmp_path}/last.sock", 32 << 20
    sender = subprocess.Popen([sys.executable, "-c", LAST_FRAME_JOB, endpoint, str(size)], env=child_env())
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        _wait_for((tmp_path / "last.sock").exists, 60)
        sock.connect(endpoint)
        sock.send(b"hello")
        arrived = sock.poll(5000) and sock.recv() == bytes(range(256)) * (size // 256)
        assert sender.wait(30) == 0
        assert arrived, "the frame sent before close() did not arrive"
    finally:
        sock.close(0)
        if sender.poll() is None:
            sender.kill()
            sender.wait()


def test_the_warm_spare_leaves_when_its_sidecar_was_killed_and_left_its_socket_file(tmp_path):
    # kill -9 leaves the sidecar's socket file: nobody listens there, the spare must not stay forever.
    endpoint = f"ipc://{tmp_path}/sc.sock"
    first = SidecarProcess(endpoint, "passthrough", tmp_path / "first.log", extra_args=["--warm-spare"])
    try:
        _wait_for((tmp_path / "sc.sock.spare").exists, 120)
        first.proc.kill()
        first.proc.wait(10)
        assert (tmp_path / "sc.sock").exists()  # left behind: what the spare has to see through
    finally:
        first.stop()
        _spare_leaves(endpoint)


def _wait_for(condition, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.1)


def _batch_state(req_id: str):
    batch = SimpleNamespace(req_ids=[req_id], num_tokens=1, query_start_loc_np=np.arange(2),
                            num_computed_tokens_np=np.full(1, 3), prefill_len_np=np.full(1, 3))
    return SimpleNamespace(input_batch=batch, hidden_states=None)


@pytest.mark.parametrize("upgrade_count", [2, pytest.param(8, marks=pytest.mark.slow)])  # 8: a long random schedule
@pytest.mark.parametrize("hooks", ["passthrough", "tests.support.asking_hooks:AskEveryStepHooks"])
def test_upgrades_at_random_moments_lose_no_step_of_a_real_shim_link(tmp_path, hooks, upgrade_count):
    # The shim's own link, connections and rings (vLLM's batches faked) against real sidecars:
    # bursts of steps, now and then a long forward, idle spells around IDLE_HANDOVER_S, and
    # upgrades at random moments. Every step reaches exactly one sidecar's hooks. Pass-through
    # steps end with StepTicks; asking hooks take a plan every step, the answer a quiet spell's
    # StepStart asks for riding its round trip (a hand-over found there switches mid-step), half of
    # them asked early (the StepBegin sent before pre_forward takes the plan).
    from omni_sidecar.client import SidecarClient
    from worker_shim.config import RingConfig
    from worker_shim.wire.connection import SidecarConnection
    from worker_shim.step.link import SidecarLink

    endpoint = f"ipc://{tmp_path}/sc.sock"
    first = SidecarProcess(endpoint, hooks, tmp_path / "first.log", extra_args=["--warm-spare"])
    hello = Hello(PROTOCOL_MAJOR, PROTOCOL_MINOR, "test", "none", "cpu", 0, 1, "m", 8, "float32", 64, [],
                  pid=os.getpid())

    def connect(endpoint: str = endpoint, resume_token: str = "") -> SidecarConnection:
        return SidecarConnection(endpoint, 10.0, msgspec.structs.replace(hello, resume_token=resume_token),
                                 1 << 16, 2, arena_prefix="omni-test-race", ring=RingConfig())

    rng, upgrades = random.Random(7), []
    conn = connect()
    conn.connect(10.0)
    link = SidecarLink(connect, conn, length_finishes=False)

    def upgrade_now_and_then() -> None:
        for _ in range(upgrade_count):
            time.sleep(rng.uniform(0.0, 0.6))
            upgrades.append(subprocess.run(
                [sys.executable, "-m", "omni_sidecar.cli", "upgrade", "--endpoint", endpoint, "--timeout", "60",
                 "--", "--hooks", hooks], capture_output=True, text=True, env=child_env()))

    try:
        _wait_for((tmp_path / "sc.sock.spare").exists, 120)
        upgrader = threading.Thread(target=upgrade_now_and_then)
        upgrader.start()
        steps = 0
        while upgrader.is_alive():
            req_id = f"r{steps}"
            link.note_new([SimpleNamespace(req_id=req_id, prompt_token_ids=[1, 2, 3], prompt_len=3,
                                           sampling_params=SimpleNamespace(extra_args=None))])
            for _ in range(rng.randint(1, 20)):
                state = _batch_state(req_id)
                link.begin_step()
                if rng.random() < 0.5:  # as the runner asks: the StepBegin when the batch is built
                    link.ask_early(state.input_batch)
                    time.sleep(rng.choice([0.0, 0.001]))  # vLLM's attention metadata
                link.pre_forward(state.input_batch, None)
                time.sleep(rng.choice([0.001, 0.003, 0.01, 1.5 * IDLE_HANDOVER_S]))  # the forward
                link.end_step(state)
                steps += 1
            link.note_finished({req_id}, None)
            time.sleep(rng.uniform(0.0, 1.5 * IDLE_HANDOVER_S))
        upgrader.join()
        link.begin_step()
        link.end_step(None)  # the last finish notice
        link.flush()
        stats = link.stats()
        with SidecarClient(endpoint) as client:
            status = client.status()
        assert [u.returncode for u in upgrades] == [0] * upgrade_count, [u.stdout + u.stderr for u in upgrades]
        assert stats["losses"] == 0 and stats["request_errors"] == {} and stats["steps"] == steps
        (session,) = status.sessions
        assert session.steps == steps and session.errors == 0
        if hooks != "passthrough":  # every step got its plan, from exactly one sidecar
            assert stats["blocking_exchanges"] == steps
    finally:
        link.close()
        _stop_sidecars(endpoint, first)
        _spare_leaves(endpoint)


def test_the_first_request_after_a_sidecar_came_back_is_served(tmp_path):
    # The sidecar was killed and a new one started while vLLM was idle: no step ran to reconnect.
    # The request that arrives next must reach the new sidecar, not be failed as "no omni-sidecar
    # was connected" (vLLM adds requests before the step that would reconnect).
    from worker_shim.config import RingConfig
    from worker_shim.wire.connection import SidecarConnection
    from worker_shim.step.link import SidecarLink

    endpoint = f"ipc://{tmp_path}/sc.sock"
    first = SidecarProcess(endpoint, "passthrough", tmp_path / "first.log")
    hello = Hello(PROTOCOL_MAJOR, PROTOCOL_MINOR, "test", "none", "cpu", 0, 1, "m", 8, "float32", 64, [],
                  pid=os.getpid())

    def connect(endpoint: str = endpoint, resume_token: str = "") -> SidecarConnection:
        return SidecarConnection(endpoint, 10.0, msgspec.structs.replace(hello, resume_token=resume_token),
                                 1 << 16, 2, arena_prefix="omni-test-back", ring=RingConfig())

    def request(req_id: str) -> SimpleNamespace:
        return SimpleNamespace(req_id=req_id, prompt_token_ids=[1, 2, 3], prompt_len=3,
                               sampling_params=SimpleNamespace(extra_args=None))

    conn = connect()
    conn.connect(10.0)
    link = SidecarLink(connect, conn, length_finishes=False)
    second = None
    try:
        link.note_new([request("before")])
        link.begin_step()
        link.end_step(_batch_state("before"))
        link.note_finished({"before"}, None)
        first.proc.kill()
        first.proc.wait(10)
        deadline = time.monotonic() + 10
        while link.stats()["losses"] == 0:  # the loss is seen at a step boundary
            assert time.monotonic() < deadline, "the shim did not notice the killed sidecar"
            link.begin_step()
            link.end_step(None)
            time.sleep(0.05)
        second = SidecarProcess(endpoint, "passthrough", tmp_path / "second.log")
        link.note_new([request("after")])  # vLLM idle until now: this is the first thing the shim sees
        link.begin_step()
        link.end_step(_batch_state("after"))
        link.note_finished({"after"}, None)
        link.begin_step()
        link.end_step(None)
        stats = link.stats()
        assert "after" not in stats["request_errors"], stats["request_errors"]
        assert stats["reconnects"] == 1
    finally:
        link.close()
        first.stop()
        if second is not None:
            second.stop()


@pytest.mark.e2e
@pytest.mark.slow  # 15 upgrades in a row on a real engine
def test_upgrades_complete_under_an_idle_engine_and_alternate_with_busy_ones(tiny_model, tmp_path):
    endpoint = f"ipc://{tmp_path}/sc.sock"
    first = SidecarProcess(endpoint, "tests.support.state_hooks:StateCheckHooks", tmp_path / "sidecar.log",
                           extra_args=["--warm-spare"])
    out = tmp_path / "idle.json"
    try:
        proc = subprocess.run(
            [sys.executable, str(ROOT / "tests" / "support" / "idle_upgrade_job.py"), tiny_model, endpoint, str(out)],
            capture_output=True, text=True, env=child_env(), timeout=600,
        )
        assert out.exists(), proc.stdout[-2000:] + proc.stderr[-4000:] + "\nsidecar logs:\n" + _logs(tmp_path)
    finally:
        _stop_sidecars(endpoint, first)
        _spare_leaves(endpoint)  # no sidecar serves there: the spare leaves
    res = json.loads(out.read_text())
    # Five upgrades with no traffic: each returns 0 within 2 s (the old sidecar hands the idle
    # session over at once, the warm spare forks the new one), and they chain: the batch after
    # them is served by the last hook set.
    idle = res["idle"]
    assert [u["rc"] for u in idle] == [0] * 5, idle
    assert all("forked by the warm spare" in u["out"] for u in idle), idle
    assert all(u["seconds"] < 2.0 for u in idle), [u["seconds"] for u in idle]
    assert res["status_before_batch"] == "state-check-last"
    after = res["stats_after_idle"]
    assert after["hook_set"] == "state-check-last" and after["switches"] == 1
    assert after["request_errors"] == {} and after["losses"] == 0
    assert res["after_idle"] == res["ref"]
    # Ten more, alternating idle and busy: no failed request, tokens as without upgrades.
    alternating = res["alternating"]
    assert [u["rc"] for u in alternating] == [0] * 10, alternating
    assert [u["busy"] for u in alternating] == [False, True] * 5
    stats = res["stats"]
    assert stats["request_errors"] == {} and stats["losses"] == 0  # state checked at every step
    assert stats["switches"] == 1 + 10
    assert res["tokens"] == [res["ref"]] * 5

