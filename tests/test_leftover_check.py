"""The session-wide leftover check (tests/conftest.py) catches what a test forgets to clean up.

Each case runs a small pytest session of its own under our conftest: one that cleans up passes,
one that leaves a process, a /dev/shm file or a socket file in the temporary directory fails and
names each.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

import pytest

from tests.support.procs import ROOT, child_env

INNER_TEST = '''
import os, socket, subprocess, sys, tempfile, time
from pathlib import Path

def test_start_and_maybe_clean_up():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    Path(os.environ["PID_FILE"]).write_text(str(proc.pid))
    shm = Path("/dev/shm") / os.environ["SHM_NAME"]
    shm.write_bytes(b"x")
    held = open(shm, "rb")  # the sampler sees who holds it
    time.sleep(1.0)
    held.close()
    sock_path = Path(tempfile.gettempdir()) / os.environ["SOCK_NAME"]
    with socket.socket(socket.AF_UNIX) as listener:  # closed, its file stays (as a killed process's does)
        listener.bind(str(sock_path))
    if os.environ["CLEAN_UP"] == "1":
        proc.kill()
        proc.wait()
        shm.unlink()
        sock_path.unlink()
'''


@pytest.mark.parametrize("clean_up, workers", [(True, 0), (False, 0), (True, 2), (False, 2)],
                         ids=["cleans-up", "leaves", "cleans-up-in-a-worker", "leaves-in-a-worker"])
def test_the_leftover_check_fails_a_session_that_leaves_a_process_shm_file_or_socket(tmp_path, clean_up, workers):
    """With pytest-xdist workers (`make test` runs two), their controller checks what they left."""
    (tmp_path / "conftest.py").write_text(f"import sys\nsys.path.insert(0, {str(ROOT)!r})\n"
                                          "from tests.conftest import pytest_configure, pytest_sessionfinish  # noqa: F401\n")
    (tmp_path / "test_inner.py").write_text(INNER_TEST)
    pid_file, shm_name = tmp_path / "pid", f"omni-leftover-check-{uuid.uuid4().hex[:8]}"
    # The inner session's temporary directory, where its socket goes: a short path (a Unix socket's
    # is at most 107 bytes; a worker's tmp_path is longer than that allows).
    inner_tmp = Path(tempfile.mkdtemp(prefix="olc-", dir=os.environ.get("OMNI_TEST_TMPDIR")))
    sock_path = inner_tmp / f"omni-leftover-check-{uuid.uuid4().hex[:8]}.sock"
    env = child_env(PID_FILE=str(pid_file), SHM_NAME=shm_name, SOCK_NAME=sock_path.name,
                    CLEAN_UP="1" if clean_up else "0", OMNI_LEFTOVER_GRACE_S="1", TMPDIR=str(inner_tmp),
                    OMNI_TEST_TMPDIR=str(inner_tmp),
                    # Only what the inner test makes counts: the outer session's other worker starts
                    # engines (re-parented to init when a job ends) and arenas meanwhile.
                    OMNI_LEFTOVER_SHM_PREFIXES="omni-leftover-check-", OMNI_LEFTOVER_ORPHAN_NAMES="")
    env.pop("OMNI_TEST_OWN_TMPDIR", None)  # the inner session's temporary directory is inner_tmp
    try:
        out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", str(workers),
                              str(tmp_path)],
                             capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120,
                             # A process group of its own: the check counts its group's processes as its
                             # own, and the outer session's other worker starts processes in ours meanwhile.
                             start_new_session=True)
        report = out.stdout + out.stderr
        if clean_up:
            assert out.returncode == 0 and "leftover check" not in report, report
        else:
            assert out.returncode != 0 and "leftover check" in report, report
            assert f"process {pid_file.read_text()}:" in report and f"/dev/shm/{shm_name}" in report, report
            assert f"socket {sock_path}" in report, report
    finally:
        if pid_file.exists():
            try:
                os.kill(int(pid_file.read_text()), signal.SIGKILL)
            except ProcessLookupError:
                pass
        if os.path.exists(f"/dev/shm/{shm_name}"):
            os.unlink(f"/dev/shm/{shm_name}")
        sock_path.unlink(missing_ok=True)
        shutil.rmtree(inner_tmp, ignore_errors=True)
