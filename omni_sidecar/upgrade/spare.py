"""A warm spare for hot upgrades: a process that has imported torch and forks each new sidecar.

Most of an upgrade's time is the new sidecar's start-up: Python, then torch (seconds on a busy
host), then the hooks. With `serve --warm-spare` a sidecar starts one spare per socket
(`<socket>.spare`, unless one answers there), and `omni-sidecar upgrade` asks it for the new
sidecar. The spare forks it with torch already in memory; our packages and the hook module
are imported afresh from disk in the child (the spare keeps none of them), with the asking
command's working directory, `sys.path` and environment, so the new code is what runs. The
spare does no tensor work, so no thread pool is half-copied into a child.

It lives while a sidecar listens at the endpoint (its socket file exists and, when probed now
and then, takes connections: a killed sidecar leaves its file behind), answers only its own uid
(SO_PEERCRED) on an owner-only socket in the sidecar's 0700 directory, and parses JSON only.
Torch itself stays the version the spare imported: upgrading torch on disk needs a restart
(or `upgrade --cold`). See docs/ARCHITECTURE.md, Hot upgrade.

Run as `python -m omni_sidecar.upgrade.spare ENDPOINT`; imports only the standard library and
proto.endpoint until it preloads torch and the other libraries a sidecar needs (no context,
socket or thread of theirs is made before a fork).
"""

from __future__ import annotations

import gc
import importlib
import json
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import traceback
from typing import Any, NoReturn

from proto.endpoint import ipc_path

# What each sidecar's start-up spends its time on, none of it ours (torch: seconds).
PRELOADED = ("torch", "numpy", "msgspec", "zmq", "prometheus_client")
FRESH_PACKAGES = ("omni_sidecar", "proto", "omni_arena")  # never carried into a forked sidecar
CHECK_S = 1.0  # how often the spare reaps its children and looks for the sidecar's socket
PROBE_EVERY = 5  # checks between connection probes (each is an accept on the sidecar's side)
ASK_TIMEOUT_S = 2.0
REQUEST_MAX_BYTES = 1 << 20
_PEERCRED = struct.Struct("3i")  # pid, uid, gid


def spare_path(endpoint: str) -> str | None:
    path = ipc_path(endpoint)
    return f"{path}.spare" if path is not None else None


def ensure_spare(endpoint: str) -> None:
    """Start the endpoint's spare unless one answers; detached: it outlives this sidecar."""
    path = spare_path(endpoint)
    if path is None or _answers(path):
        return
    subprocess.Popen([sys.executable, "-m", "omni_sidecar.upgrade.spare", endpoint], stdin=subprocess.DEVNULL,
                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)


def fork_sidecar(endpoint: str, argv: list[str], log_path: str) -> int | None:
    """The pid of a sidecar the spare forked to run `omni-sidecar ARGV` (None: no spare answered)."""
    path = spare_path(endpoint)
    if path is None or not os.path.exists(path):
        return None
    request = {"argv": argv, "log": log_path, "cwd": os.getcwd(), "path": sys.path,
               "env": dict(os.environ), "executable": sys.executable}
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(ASK_TIMEOUT_S)
            sock.connect(path)
            sock.sendall(json.dumps(request).encode() + b"\n")
            reply = json.loads(sock.makefile("rb").readline(REQUEST_MAX_BYTES))
        pid = reply["pid"]
        return pid if isinstance(pid, int) and pid > 0 else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def exited(pid: int) -> bool:
    """True once `pid` is gone or a zombie (a process the spare forked is not our child)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return True
    return stat[stat.rfind(b")") + 2:].startswith(b"Z")


def _answers(path: str) -> bool:
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(ASK_TIMEOUT_S)
            sock.connect(path)
        return True
    except OSError:
        return False


# -- the spare process ---------------------------------------------------------------


def serve(endpoint: str) -> None:
    path, sidecar_path = spare_path(endpoint), ipc_path(endpoint)
    if path is None or sidecar_path is None:
        raise SystemExit(f"omni-sidecar spare: {endpoint!r} is not an ipc:// endpoint")
    for name in PRELOADED:
        importlib.import_module(name)
    gc.freeze()  # torch's objects: no collection in a child walks them (~0.2 s each)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old_umask = os.umask(0o077)
    try:
        if os.path.exists(path):
            os.unlink(path)  # a dead spare's (ensure_spare found nobody answering)
        listener.bind(path)
    finally:
        os.umask(old_umask)
    listener.listen(8)
    inode = os.stat(path).st_ino
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    missing = 0  # checks in a row without a sidecar (a takeover replaces its socket in place)
    checks = 0
    try:
        while missing < 2:
            if select.select([listener], [], [], CHECK_S)[0]:
                _answer(listener)
                continue
            _reap()
            checks += 1
            probe = missing > 0 or checks % PROBE_EVERY == 0
            missing = 0 if _sidecar_present(sidecar_path, probe) else missing + 1
    finally:
        # Unlink while still bound: once closed, our inode number may be reused by a new file.
        try:
            if os.stat(path).st_ino == inode:
                os.unlink(path)
        except FileNotFoundError:
            pass
        listener.close()


def _sidecar_present(sidecar_path: str, probe: bool) -> bool:
    """The sidecar's socket file exists (and, when `probe`, something accepts connections on it)."""
    if not os.path.exists(sidecar_path):
        return False
    if not probe:
        return True
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(ASK_TIMEOUT_S)
            sock.connect(sidecar_path)
    except (ConnectionRefusedError, FileNotFoundError):
        return False  # a dead sidecar's file, or gone meanwhile
    except OSError:
        pass  # busy (a full backlog, a timeout): someone is there
    return True


def _reap() -> None:
    try:
        while os.waitpid(-1, os.WNOHANG)[0] > 0:
            pass
    except ChildProcessError:
        pass


def _answer(listener: socket.socket) -> None:
    conn, _ = listener.accept()
    with conn:
        conn.settimeout(ASK_TIMEOUT_S)
        try:
            _, uid, _ = _PEERCRED.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))
            if uid != os.getuid():
                return
            request = _parse(conn.makefile("rb").readline(REQUEST_MAX_BYTES))
        except (OSError, ValueError):
            return
        if request is None:
            return  # a probe (ensure_spare), or not ours to run
        pid = os.fork()
        if pid == 0:
            listener.close()
            conn.close()
            _become_sidecar(request)
        try:
            conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
        except OSError:
            pass  # the asker gave up; the new sidecar times out on its own


def _parse(line: bytes) -> dict[str, Any] | None:
    if not line:
        return None
    request = json.loads(line)
    if not isinstance(request, dict) or request.get("executable") != sys.executable:
        return None  # another interpreter: the asker starts the sidecar itself
    texts = (request.get("log"), request.get("cwd"))
    lists = (request.get("argv"), request.get("path"))
    env = request.get("env")
    if (not all(isinstance(t, str) for t in texts) or not isinstance(env, dict)
            or not all(isinstance(v, list) and all(isinstance(a, str) for a in v) for v in lists)
            or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items())):
        return None
    return request


def _become_sidecar(request: dict[str, Any]) -> NoReturn:
    code = 1
    try:
        os.setsid()
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGCHLD):
            signal.signal(sig, signal.SIG_DFL)
        log_fd = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        null_fd = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null_fd, 0)
        os.dup2(log_fd, 1)
        os.dup2(log_fd, 2)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        sys.path[:] = request["path"]
        for name in [m for m in sys.modules if m.split(".")[0] in FRESH_PACKAGES]:
            del sys.modules[name]
        importlib.invalidate_caches()
        cli = importlib.import_module("omni_sidecar.cli")
        code = cli.main(request["argv"])
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: python -m omni_sidecar.upgrade.spare ENDPOINT")
    serve(sys.argv[1])
