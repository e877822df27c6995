"""The sidecar's torch intra-op threads (`serve --torch-threads`, default 1), in a real sidecar process."""

from __future__ import annotations

import pytest

from tests.support.procs import SidecarProcess


@pytest.mark.parametrize("flag, expected", [([], "1"), (["--torch-threads", "3"], "3"), (["--torch-threads", "0"], "2")])
def test_the_sidecar_runs_its_hooks_with_the_threads_it_was_given(tmp_path, flag, expected):
    out = tmp_path / "threads.txt"
    sidecar = SidecarProcess(f"ipc://{tmp_path}/t.sock", "tests.support.probe_hooks:ThreadsProbeHooks",
                             tmp_path / "sidecar.log", options=[f"out={out}"], extra_args=flag,
                             env={"OMP_NUM_THREADS": "2"})  # torch's own default there: 2, not the sidecar's
    try:
        assert out.read_text() == expected
    finally:
        sidecar.stop()


def test_a_negative_thread_count_is_refused_in_one_line(tmp_path):
    import subprocess
    import sys

    from tests.support.procs import child_env

    res = subprocess.run([sys.executable, "-m", "omni_sidecar.cli", "serve", "--endpoint", f"ipc://{tmp_path}/t.sock",
                          "--torch-threads", "-1"], capture_output=True, text=True, timeout=60, env=child_env())
    assert res.returncode != 0
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "torch_threads" in lines[0], res.stderr
