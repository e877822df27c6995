"""The wire never executes what it receives; who may connect is checked."""

from __future__ import annotations

import ast
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.procs import ROOT, SidecarProcess, child_env

WIRE_PACKAGES = ["proto", "omni_sidecar", "worker_shim", "omni_arena"]
FORBIDDEN_MODULES = {"pickle", "cPickle", "cloudpickle", "dill", "marshal", "shelve", "jsonpickle"}
FORBIDDEN_CALLS = {"eval", "exec", "recv_pyobj", "send_pyobj", "recv_serialized", "loads_pickle"}


def _py_files():
    for pkg in WIRE_PACKAGES:
        yield from (ROOT / pkg).rglob("*.py")


def _offences(tree: ast.AST, path: str) -> list[str]:
    offences = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name.split(".")[0] for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = [(node.module or "").split(".")[0]]
        else:
            names = []
        offences += [f"{path}:{node.lineno} imports {n}" for n in names if n in FORBIDDEN_MODULES]
        if isinstance(node, ast.Call):
            func = node.func
            name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", "")
            if name in FORBIDDEN_CALLS:
                offences.append(f"{path}:{node.lineno} calls {name}")
            if name == "load" and any(k.arg == "allow_pickle" for k in node.keywords):
                offences.append(f"{path}:{node.lineno} np.load with allow_pickle")
            if name == "load" and isinstance(func, ast.Attribute) and getattr(func.value, "id", "") == "torch":
                offences.append(f"{path}:{node.lineno} torch.load (pickle)")
    return offences


def test_no_pickle_marshal_or_eval_anywhere_in_the_wire_packages():
    offences = []
    for path in _py_files():
        offences += _offences(ast.parse(path.read_text(), str(path)), str(path))
    assert offences == []


def test_the_scan_would_catch_an_offence():
    """The scan above is not vacuous: it flags each pattern it looks for."""
    bad = ast.parse(
        "import pickle\nfrom marshal import loads\nsock.recv_pyobj()\neval('1')\n"
        "torch.load(f)\nnp.load(f, allow_pickle=True)\nimport os\n"
    )
    assert len(_offences(bad, "bad.py")) == 6


def test_socket_is_0600_in_a_0700_directory(tmp_path):
    sock_dir = tmp_path / "private"
    sidecar = SidecarProcess(f"ipc://{sock_dir}/s.sock", "passthrough", tmp_path / "sidecar.log")
    try:
        assert stat.S_IMODE(os.stat(sock_dir).st_mode) == 0o700
        assert stat.S_IMODE(os.stat(sock_dir / "s.sock").st_mode) == 0o600
    finally:
        sidecar.stop()


def _serve(endpoint: str, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "omni_sidecar.cli", "serve", "--endpoint", endpoint, *extra],
        capture_output=True, text=True, env=child_env(), timeout=60,
    )


def test_refuses_a_directory_open_to_others_tcp_without_keys_and_a_second_sidecar(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o755)
    os.chmod(shared, 0o755)
    res = _serve(f"ipc://{shared}/s.sock")
    assert res.returncode == 2 and "open to other users" in res.stderr
    res = _serve("tcp://127.0.0.1:5599")
    assert res.returncode == 2 and "refused without CURVE keys" in res.stderr
    sidecar = SidecarProcess(f"ipc://{tmp_path}/one.sock", "passthrough", tmp_path / "sidecar.log")
    try:
        res = _serve(f"ipc://{tmp_path}/one.sock")
        assert res.returncode == 2 and "another omni-sidecar is serving" in res.stderr
        assert sidecar.proc.poll() is None
    finally:
        sidecar.stop()


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to act as another uid")
def test_peer_credentials_refuse_another_uid_even_if_the_socket_is_reachable(tmp_path):
    import shutil
    import tempfile

    base = Path(tempfile.mkdtemp(dir="/tmp", prefix="omni-peer-"))  # /tmp is traversable by all
    sock_dir = base / "p"
    sidecar = SidecarProcess(f"ipc://{sock_dir}/s.sock", "passthrough", tmp_path / "sidecar.log")
    try:
        # Simulate a misconfigured deployment: the filesystem lets everyone in.
        os.chmod(base, 0o755)
        os.chmod(sock_dir, 0o755)
        os.chmod(sock_dir / "s.sock", 0o666)
        probe = (
            "import os, sys, zmq, msgspec\n"  # imported as root: the interpreter lives in root's home
            "os.setgid(65534); os.setuid(65534)\n"
            f"path = '{sock_dir}/s.sock'\n"
            "s = zmq.Context().socket(zmq.DEALER); s.setsockopt(zmq.LINGER, 0)\n"
            "s.connect('ipc://' + path)\n"
            "s.send(msgspec.msgpack.encode({'type': 'ping', 'nonce': 7}))\n"
            "print(os.access(path, os.W_OK), 'answered' if s.poll(1500) else 'refused')\n"
        )
        other = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=30,
                               env=child_env())
        # The socket file was writable for that uid, so only the uid check kept it out.
        assert other.stdout.strip() == "True refused", other.stdout + other.stderr
        # The owner still gets answers.
        from omni_sidecar.client import SidecarClient

        with SidecarClient(sidecar.endpoint) as client:
            assert client.ping(3) == 3
    finally:
        sidecar.stop()
        shutil.rmtree(base, ignore_errors=True)


def test_tcp_with_curve_keys_admits_only_authorized_clients(tmp_path):
    import zmq.auth

    from omni_sidecar.client import SidecarClient, SidecarUnavailable

    server_dir, good, bad = tmp_path / "server", tmp_path / "good", tmp_path / "bad"
    for d in (server_dir, good, bad):
        d.mkdir()
    server_pub, _ = zmq.auth.create_certificates(str(server_dir), "server")
    (server_dir / "authorized").mkdir()
    good_pub, _ = zmq.auth.create_certificates(str(good), "client")
    zmq.auth.create_certificates(str(bad), "client")
    Path(good_pub).rename(server_dir / "authorized" / "client.key")
    for d in (good, bad):
        (d / "server.key").write_bytes(Path(server_pub).read_bytes())
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    endpoint = f"tcp://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "omni_sidecar.cli", "serve", "--endpoint", endpoint,
         "--curve-keys", str(server_dir)],
        stdout=open(tmp_path / "sidecar.log", "w"), stderr=subprocess.STDOUT, env=child_env(),
    )
    try:
        for _ in range(50):
            try:
                with SidecarClient(endpoint, timeout_s=0.5, curve_keys=str(good)) as c:
                    assert c.ping(5) == 5
                    break
            except SidecarUnavailable:
                continue
        else:
            pytest.fail((tmp_path / "sidecar.log").read_text())
        with pytest.raises(SidecarUnavailable):
            with SidecarClient(endpoint, timeout_s=1.0, curve_keys=str(bad)) as c:
                c.ping()
        with pytest.raises(SidecarUnavailable):  # no encryption at all
            with SidecarClient(endpoint, timeout_s=1.0) as c:
                c.ping()
    finally:
        proc.terminate()
        proc.wait(10)
