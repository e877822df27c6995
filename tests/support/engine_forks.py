"""Engine jobs forked from one Python that has torch and vLLM imported already.

An engine job spends most of its start importing torch and vLLM (about 6 s of 9 on the 2-core
test machine). Inside a test session, run_engine (procs.py) asks this server instead: it imports
them once, and each job is a fork of it that runs the job script as `__main__`. A job is still a
process of its own: its environment, working directory, log and exit status are the job's, and
the processes vLLM spawns for it (EngineCore, Worker) start from the job script as before.
Usage: python engine_forks.py SOCKET_PATH (EngineForks below starts and stops it).
"""

from __future__ import annotations

import importlib
import json
import os
import runpy
import select
import signal
import socket
import subprocess
import sys
import time
import traceback
from pathlib import Path

# What every engine job imports before it builds an engine; nothing of ours, so each job runs
# the code on disk.
PRELOAD = ("numpy", "torch", "vllm", "vllm.entrypoints.llm", "vllm.sampling_params")
SCRIPT = Path(__file__).resolve()


def serve(path: str) -> None:
    env_before = dict(os.environ)
    for name in PRELOAD:
        importlib.import_module(name)
    # What the imports put in the environment: a fresh job process would have it too.
    set_by_imports = {k: v for k, v in os.environ.items() if env_before.get(k) != v}
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(f"{path}.new")
    listener.listen()
    os.rename(f"{path}.new", path)  # the path appears once it accepts: EngineForks waits for it
    waiting: dict[int, socket.socket] = {}  # job pid -> the connection its exit status goes to
    while True:
        ready, _, _ = select.select([listener], [], [], 0.1)
        if ready:
            conn, _ = listener.accept()
            request = json.loads(_read_line(conn))
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                listener.close()
                conn.close()
                code = _run_job(request, set_by_imports)
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
            conn.sendall(f"{pid}\n".encode())
            waiting[pid] = conn
        while waiting:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            conn = waiting.pop(pid, None)
            if conn is not None:
                try:
                    conn.sendall(f"{os.waitstatus_to_exitcode(status)}\n".encode())
                except OSError:
                    pass  # the caller gave up on it (its timeout)
                conn.close()


def _read_line(conn: socket.socket) -> str:
    data = b""
    while not data.endswith(b"\n"):
        chunk = conn.recv(65536)
        if not chunk:
            raise ConnectionError("the connection closed mid-line")
        data += chunk
    return data.decode()


def _run_job(request: dict, set_by_imports: dict[str, str]) -> int:
    """In the forked child: `python SCRIPT ARGS...` with the job's environment and log; its exit code."""
    try:
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update({**set_by_imports, **request["env"]})
        log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        script = request["argv"][0]
        sys.argv = list(request["argv"])
        sys.path[0] = os.path.dirname(os.path.abspath(script))  # as `python SCRIPT` has it
        runpy.run_path(script, run_name="__main__")
        return 0
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            return exc.code or 0
        print(exc.code, file=sys.stderr)
        return 1
    except BaseException:
        traceback.print_exc()
        return 1


class EngineForks:
    """The test session's fork server, started on first use and stopped with the session."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = Path(workdir)
        self.path = str(self.workdir / "forks.sock")
        self.proc: subprocess.Popen | None = None
        self.jobs = 0
        self._live: set[int] = set()

    def _start(self, env: dict[str, str]) -> None:
        self._log = open(self.workdir / "engine-forks.log", "w")
        self.proc = subprocess.Popen([sys.executable, str(SCRIPT), self.path], stdin=subprocess.DEVNULL,
                                     stdout=self._log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + 300
        while not os.path.exists(self.path):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the engine fork server did not start:\n"
                                   f"{(self.workdir / 'engine-forks.log').read_text()[-4000:]}")
            time.sleep(0.05)

    def run(self, argv: list[str], env: dict[str, str], log_path: Path, timeout_s: float) -> int:
        """Runs `python ARGV...` as a fork; its exit status (a negative signal number if killed)."""
        if self.proc is None:
            self._start(env)
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect(self.path)
        try:
            conn.sendall(json.dumps({"argv": [str(a) for a in argv], "env": env, "log": str(log_path),
                                     "cwd": os.getcwd()}).encode() + b"\n")
            pid = int(_read_line(conn))
            self.jobs += 1
            self._live.add(pid)
            conn.settimeout(timeout_s)
            try:
                status = int(_read_line(conn))
            except BaseException as exc:  # a timeout or an interrupt: the job must not outlive its test
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self._live.discard(pid)
                if isinstance(exc, socket.timeout):
                    raise subprocess.TimeoutExpired(argv, timeout_s) from None
                raise
            self._live.discard(pid)
            return status
        finally:
            conn.close()

    def stop(self) -> None:
        for pid in self._live:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self.proc is not None:
            self.proc.kill()  # it holds nothing a job needs once the jobs are gone
            self.proc.wait()
            self._log.close()
            Path(self.path).unlink(missing_ok=True)
            self.proc = None


if __name__ == "__main__":
    serve(sys.argv[1])
