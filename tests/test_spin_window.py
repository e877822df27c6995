"""The sidecar's polling window stretches over regular steps' quiet spells and shrinks back when
the engine stops stepping (proto/transport.py, SpinWindow); a hot ring loop notes the spells."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from omni_sidecar.serve.config import ServeConfig
from omni_sidecar.serve import peers as peers_module
from omni_sidecar.serve.peers import PeerTable
from proto.transport import AUTO_MAX_US, KEEP, STRETCH, SpinWindow, auto_max_us, cpus_to_run_on


def test_the_window_covers_regular_quiet_spells_and_falls_back_after_a_long_one():
    spin = SpinWindow(base_us=2000, max_us=20_000)
    assert spin.seconds == pytest.approx(0.002)
    for quiet in (0.0031, 0.00002, 0.0009) * 3:  # a step: after the StepEnd, StepStart -> StepBegin, the forward
        spin.note_quiet(quiet)
    assert spin.seconds == pytest.approx(0.0031 * STRETCH)
    spin.note_quiet(5.0)  # the engine went idle: its first message after that
    assert spin.seconds == pytest.approx(0.002)
    for _ in range(KEEP - 1):
        spin.note_quiet(0.004)
    assert spin.seconds == pytest.approx(0.002)  # the long spell is still remembered
    spin.note_quiet(0.004)
    assert spin.seconds == pytest.approx(0.004 * STRETCH)
    for _ in range(KEEP):
        spin.note_quiet(0.019)
    assert spin.seconds == pytest.approx(0.020)  # never past max_us
    spin.note_quiet(0.0001)
    assert spin.seconds == pytest.approx(0.020)


def test_without_room_to_stretch_the_window_stays_the_configured_one():
    spin = SpinWindow(base_us=2000, max_us=2000)
    for _ in range(KEEP):
        spin.note_quiet(0.003)
    assert not spin.stretches and spin.seconds == pytest.approx(0.002)
    assert auto_max_us(2000, cpus=2) == 2000 and auto_max_us(2000, cpus=16) == AUTO_MAX_US
    assert auto_max_us(50_000, cpus=16) == 50_000  # never below the configured window
    assert auto_max_us(0, cpus=16) == 0  # polling off: the operator's word
    with pytest.raises(ValueError, match="ring_spin_max_us"):
        ServeConfig(ring_spin_max_us=-2)


def test_a_cgroup_quota_caps_the_cpus_counted_as_spare(tmp_path):
    limited = tmp_path / "cpu.max"
    limited.write_text("200000 100000\n")  # 2 CPUs' worth
    assert cpus_to_run_on(str(limited)) <= 2.0
    unlimited = tmp_path / "unlimited"
    unlimited.write_text("max 100000\n")
    assert cpus_to_run_on(str(unlimited)) == cpus_to_run_on(str(tmp_path / "absent")) >= 1


def test_only_step_traffic_stretches_the_window_not_a_client_polling_status():
    """A connected shim that does not step and a client asking for status every few ms: the control
    frames keep the loop busy but must not stretch the window (the sidecar would never sleep)."""
    from omni_sidecar.serve.server import SidecarServer
    from proto.transport import WaitPolicy

    server = SidecarServer.__new__(SidecarServer)
    server.spin = SpinWindow(base_us=2000, max_us=20_000)
    server.wait = WaitPolicy(spin_us=2000, sleep_ms=2)
    server._busy_at = time.monotonic()
    server._socket_due = 0.0
    served = {"ring": 0}
    server.peers = SimpleNamespace(pump=lambda dispatch: False,
                                   serve_hot=lambda *a, **k: time.monotonic(), ring_transports=lambda: [])
    server.listener = SimpleNamespace(readable=lambda: True, recv_frames=lambda: [])
    server._serve = lambda frames: None
    server._dispatch = None
    server._loop_wanted = lambda: False
    for _ in range(2 * KEEP):
        time.sleep(0.003)
        server._serve_rings_once()
    assert not server.spin._quiet and server.spin.seconds == pytest.approx(0.002)
    server.peers.pump = lambda dispatch: served.__setitem__("ring", served["ring"] + 1) or True
    for _ in range(KEEP):
        time.sleep(0.003)
        server._serve_rings_once()
    assert served["ring"] == KEEP and server.spin.seconds > 0.003  # step traffic does


def test_the_hot_ring_loop_notes_each_quiet_spell_that_ends_in_a_message(monkeypatch):
    # A clock that moves 0.1 ms a read: the spells are the same on a loaded machine.
    now = [0.0]

    def clock() -> float:
        now[0] += 0.0001
        return now[0]

    monkeypatch.setattr(peers_module, "time", SimpleNamespace(monotonic=clock))
    monkeypatch.setattr(peers_module.os, "sched_yield", lambda: None)
    table = PeerTable.__new__(PeerTable)
    arrivals = [0.003, 0.006]  # two messages, 3 ms apart, then nothing

    def has_data() -> bool:
        return bool(arrivals) and now[0] >= arrivals[0]

    rx = SimpleNamespace(has_data=has_data)
    table._peers = {b"p": SimpleNamespace(rings=SimpleNamespace(closed=False, queued=False, duplex=SimpleNamespace(rx=rx)))}
    table.serve_one = lambda peer, dispatch: arrivals.pop(0) is not None
    spin = SpinWindow(base_us=10_000, max_us=40_000)
    table.serve_hot(lambda *a: None, until=0.05, busy_at=0.0, spin=spin, loop_wanted=lambda: False)
    assert not arrivals
    assert list(spin._quiet) == [pytest.approx(0.003, abs=0.0005)] * 2
    assert spin.seconds == pytest.approx(max(0.010, max(spin._quiet) * STRETCH))
