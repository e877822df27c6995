"""Deployment files that really run: compose validated by a real compose implementation, the
CPU compose's commands run as local processes, k8s manifests schema-checked, daemon signals."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from omni_sidecar.serve.config import HELP, ConfigError, ServeConfig, load_config, settings
from tests.support.procs import ROOT, SidecarProcess, child_env

DEPLOY = ROOT / "deploy"


def compose_config(name: str, **env: str) -> dict:
    exe = shutil.which("docker-compose")
    assert exe, "docker-compose is needed to validate deploy/*.yml: apt-get install docker-compose (make install does)"
    proc = subprocess.run([exe, "-f", str(DEPLOY / name), "config"], capture_output=True, text=True,
                          env={**os.environ, **env}, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return yaml.safe_load(proc.stdout)


def _env(service: dict) -> dict:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {k: str(v) for k, v in env.items()}


def _mounts(service: dict) -> dict[str, str]:
    out = {}
    for v in service.get("volumes", []):
        if isinstance(v, str):
            src, dst = v.split(":")[:2]
        else:
            src, dst = v.get("source"), v["target"]
        out[dst] = src
    return out


@pytest.mark.parametrize("name, gpu", [("docker-compose.yml", True), ("docker-compose.cpu.yml", False)])
def test_compose_files_validate_and_keep_their_invariants(name, gpu, tmp_path):
    cfg = compose_config(name, MODEL="/models/tiny", MODELS_DIR=str(tmp_path))
    services = cfg["services"]
    vllm, sidecar, anchor = services["vllm"], services["sidecar"], services["ipc-anchor"]
    assert sidecar["build"]["dockerfile"].endswith("Dockerfile.sidecar")
    assert vllm["build"]["dockerfile"].endswith("Dockerfile.vllm")
    # One IPC namespace (shared /dev/shm, CUDA IPC) owned by neither, so each can be recreated.
    assert anchor["ipc"] == "shareable"
    assert vllm["ipc"] == sidecar["ipc"] == "service:ipc-anchor"
    # The socket: same named volume, same path, same endpoint on both sides.
    assert _mounts(vllm)["/run/omni"] == _mounts(sidecar)["/run/omni"] == "omni-sock"
    assert _env(vllm)["OMNI_SIDECAR_ENDPOINT"] == _env(sidecar)["OMNI_SIDECAR_ENDPOINT"] == "ipc:///run/omni/sidecar.sock"
    assert "worker_shim.Worker" in vllm["command"] and "--no-enable-prefix-caching" in vllm["command"]
    assert sidecar["healthcheck"]["test"][1:3] == ["omni-sidecar", "status"]
    assert vllm["depends_on"]["sidecar"]["condition"] == "service_healthy"
    assert vllm["restart"] == "unless-stopped" and sidecar["restart"] == "on-failure"
    assert "--takeover-if-running" in sidecar["command"]
    assert sidecar["stop_signal"] == "SIGTERM"
    for svc in (vllm, sidecar):
        devices = svc.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices", [])
        assert bool(devices) == gpu
        if gpu:
            assert devices[0]["capabilities"] == ["gpu"]


def test_sidecar_image_has_no_vllm():
    text = (DEPLOY / "Dockerfile.sidecar").read_text()
    code = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
    # Dependencies in their own layer (from pyproject.toml alone), then the project without deps:
    # a code change rebuilds only the project layer.
    assert "pip install --no-cache-dir -r /tmp/deps.txt" in code
    assert "pip install --no-cache-dir --no-deps ." in code
    assert code.index("COPY pyproject.toml") < code.index("-r /tmp/deps.txt") < code.index("COPY omni_sidecar")
    assert "find_spec('vllm') is None" in code  # the build fails if vllm sneaks in
    assert not re.search(r"pip install[^\n]*vllm", code)


def test_k8s_manifests_pass_the_schema_and_keep_their_invariants():
    import kubernetes_validate

    docs = list(yaml.safe_load_all((DEPLOY / "k8s" / "omni.yaml").read_text()))
    for doc in docs:
        kubernetes_validate.validate(doc, "1.33.0", strict=True)
    deploy = next(d for d in docs if d["kind"] == "Deployment")
    pod = deploy["spec"]["template"]["spec"]
    (sidecar,) = pod["initContainers"]
    (vllm,) = pod["containers"]
    assert sidecar["restartPolicy"] == "Always"  # a native sidecar
    for c in (sidecar, vllm):
        mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
        assert mounts["omni-sock"] == "/run/omni" and mounts["dshm"] == "/dev/shm"
        assert c["resources"]["requests"]
        env = {e["name"]: e["value"] for e in c["env"]}
        assert env["OMNI_SIDECAR_ENDPOINT"] == "ipc:///run/omni/private/sidecar.sock"
    assert sidecar["livenessProbe"]["exec"]["command"][:2] == ["omni-sidecar", "status"]
    assert vllm["readinessProbe"]["httpGet"]["path"] == "/health"
    assert "worker_shim.Worker" in vllm["command"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["dshm"]["emptyDir"]["medium"] == "Memory"


def test_readme_deployment_section_matches_the_files():
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Deployment"):]
    section = section[: section.index("\n## ", 3)] if "\n## " in section[3:] else section
    named = set(re.findall(r"deploy/[\w./-]+", section))
    assert named, "the deployment section names no files"
    for path in named:
        assert (ROOT / path.rstrip(".")).exists(), f"README names {path}, which does not exist"
    for f in ("docker-compose.yml", "docker-compose.cpu.yml", "Dockerfile.vllm", "Dockerfile.sidecar",
              "k8s/omni.yaml", "systemd/omni-sidecar.service", "upgrade.sh", "sidecar.toml"):
        assert f"deploy/{f}" in section, f"README's deployment section does not mention deploy/{f}"


def test_every_setting_has_its_help_and_every_help_its_setting():
    assert set(HELP) == set(ServeConfig.__struct_fields__)
    assert all(text for text in HELP.values())
    assert [s.flag for s in settings()][:2] == ["--endpoint", "--hooks"]  # declaration order
    assert next(s for s in settings() if s.field == "log_format").choices == ("json", "plain")


def test_config_precedence(tmp_path):
    toml = tmp_path / "s.toml"
    toml.write_text('hooks = "capture"\nkeep_finished = 5\nlog_level = "DEBUG"\n[hook_options]\na = "toml"\nb = "toml"\n')
    env = {"OMNI_SIDECAR_KEEP_FINISHED": "7", "OMNI_SIDECAR_LOG_LEVEL": "WARNING"}
    cfg = load_config({"log_level": "ERROR", "hooks": None, "hook_options": {"b": "flag"}}, str(toml), env)
    assert cfg.hooks == "capture"  # toml (no flag, no env)
    assert cfg.keep_finished == 7  # env beats toml
    assert cfg.log_level == "ERROR"  # flag beats env
    assert cfg.hook_options == {"a": "toml", "b": "flag"}
    assert load_config({}, None, {}).hooks == "passthrough"  # defaults
    with pytest.raises(ConfigError, match="log_format"):
        load_config({"log_format": "xml"}, None, {})
    bad = tmp_path / "bad.toml"
    bad.write_text("nonsense_key = 1\n")
    with pytest.raises(ConfigError, match="nonsense_key"):
        load_config({}, str(bad), {})


def test_sigterm_drains_and_sighup_reloads(tmp_path):
    from tests.test_sidecar import Peer, _hello

    toml = tmp_path / "s.toml"
    toml.write_text('log_format = "plain"\nkeep_finished = 10\n')
    sidecar = SidecarProcess(f"ipc://{tmp_path}/d.sock", "passthrough", tmp_path / "sidecar.log",
                             extra_args=["--config", str(toml), "--drain-timeout", "30"])
    try:
        peer = Peer(sidecar.endpoint)
        assert type(peer.call(_hello([]))).__name__ == "Welcome"
        toml.write_text('log_format = "json"\nkeep_finished = 3\n')
        sidecar.proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 10
        while "config reloaded" not in sidecar.log_path.read_text() and time.monotonic() < deadline:
            time.sleep(0.1)
        last = sidecar.log_path.read_text().strip().splitlines()[-1]
        entry = json.loads(last)  # the new format applies to the reload line itself
        assert "'log_format': 'json'" in entry["msg"] and "'keep_finished': 3" in entry["msg"]

        sidecar.proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        other = Peer(sidecar.endpoint)
        reply = other.call(_hello([]))
        assert type(reply).__name__ == "Reject" and "draining" in reply.reason
        from proto.messages import StepEnd

        # The connected shim is still served while it is active...
        for step in range(5):
            assert type(peer.call(StepEnd(step))).__name__ == "StepResult"
            time.sleep(0.3)
        assert sidecar.proc.poll() is None
        # ...and once it goes quiet the sidecar exits cleanly.
        assert sidecar.proc.wait(10) == 0
        peer.close()
        other.close()
    finally:
        sidecar.stop()
    assert "draining" in sidecar.log_path.read_text()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _localize(argv: list[str], sock_dir: Path, port: int) -> list[str]:
    """A compose service's command, as it would run on this host."""
    exe = {"omni-sidecar": [sys.executable, "-m", "omni_sidecar.cli"], "python3": [sys.executable]}
    out = list(exe.get(argv[0], [argv[0]])) + [a.replace("/run/omni", str(sock_dir)) for a in argv[1:]]
    return [str(port) if a == "8000" else a for a in out]


@pytest.mark.e2e
@pytest.mark.slow  # the compose file's services as processes, an API server among them
def test_cpu_compose_services_complete_a_request_as_local_processes(tiny_model, tmp_path):
    cfg = compose_config("docker-compose.cpu.yml", MODEL=tiny_model, MODELS_DIR=str(tmp_path))
    sock_dir = tmp_path / "run-omni"
    port = _free_port()
    procs = []

    def start(name: str) -> subprocess.Popen:
        svc = cfg["services"][name]
        env = child_env(**{k: v.replace("/run/omni", str(sock_dir)) for k, v in _env(svc).items()})
        log = open(tmp_path / f"{name}.log", "w")
        proc = subprocess.Popen(_localize(svc["command"], sock_dir, port), env=env,
                                stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path)
        procs.append(proc)
        return proc

    try:
        sidecar = start("sidecar")
        health = _localize(cfg["services"]["sidecar"]["healthcheck"]["test"][1:], sock_dir, port)
        env = child_env(OMNI_SIDECAR_ENDPOINT=f"ipc://{sock_dir}/sidecar.sock")
        for _ in range(100):
            if subprocess.run(health, env=env, capture_output=True).returncode == 0:
                break
            time.sleep(0.2)
        else:
            pytest.fail(f"sidecar healthcheck never passed: {(tmp_path / 'sidecar.log').read_text()}")
        start("vllm")
        body = json.dumps({"model": tiny_model, "prompt": "the quick brown fox", "max_tokens": 8,
                           "temperature": 0}).encode()
        deadline = time.monotonic() + 240
        while True:
            try:
                req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                             {"Content-Type": "application/json"})
                reply = json.loads(urllib.request.urlopen(req, timeout=60).read())
                break
            except OSError:
                if time.monotonic() > deadline or procs[1].poll() is not None:
                    pytest.fail(f"vLLM never answered:\n{(tmp_path / 'vllm.log').read_text()[-4000:]}")
                time.sleep(1)
        assert reply["usage"]["completion_tokens"] == 8
        from omni_sidecar.client import SidecarClient

        with SidecarClient(f"ipc://{sock_dir}/sidecar.sock") as client:
            (session,) = client.status().sessions
        assert session.steps >= 8 and session.new_requests == 1
        assert sidecar.poll() is None
    finally:
        for proc in reversed(procs):
            proc.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()


def test_host_pip_passes_the_hosts_pip_settings_to_docker_build(tmp_path, monkeypatch):
    """tools/host_pip.py: local indexes are served on loopback for the build, URLs pass as they are."""
    from tools import host_pip

    (tmp_path / "pypi" / "simple" / "demo").mkdir(parents=True)
    (tmp_path / "pypi" / "simple" / "demo" / "index.html").write_text('<a href="../../files/demo-1.whl">d</a>')
    (tmp_path / "pypi" / "files").mkdir()
    (tmp_path / "pypi" / "files" / "demo-1.whl").write_bytes(b"wheel")
    (tmp_path / "wheels").mkdir()
    (tmp_path / "c.txt").write_text("torch<=9\n")
    monkeypatch.setattr(host_pip, "PORT", _free_port())
    monkeypatch.setattr(host_pip, "host_pip_config", lambda: {
        "extra-index-url": f"file://{tmp_path}/pypi/simple https://mirror.example/simple",
        "find-links": str(tmp_path / "wheels"), "constraint": str(tmp_path / "c.txt"),
        "cert": "/host/ca.pem", "default-timeout": "180", "no-such": "x"})
    with host_pip.build_args() as args:
        given = dict(a.split("=", 1) for a in args[1::2])
        base = f"http://127.0.0.1:{host_pip.PORT}{tmp_path}"
        assert given == {
            "PIP_EXTRA_INDEX_URL": f"{base}/pypi/simple/ https://mirror.example/simple",
            "PIP_FIND_LINKS": f"{base}/wheels/", "PIP_CONSTRAINT": f"{base}/c.txt",
            "PIP_DEFAULT_TIMEOUT": "180", "PIP_CERT": host_pip.IN_IMAGE_CA}
        # The index page's relative links resolve, as pip follows them inside the build.
        assert urllib.request.urlopen(f"{base}/pypi/simple/demo/index.html").read().startswith(b"<a")
        assert urllib.request.urlopen(f"{base}/pypi/files/demo-1.whl").read() == b"wheel"
        assert urllib.request.urlopen(f"{base}/c.txt").read() == b"torch<=9\n"
    cmd = host_pip.with_build_args(["docker", "build", "-t", "x", "."], ["--build-arg", "A=1"])
    assert cmd == ["docker", "build", "--build-arg", "A=1", "--network", "host", "-t", "x", "."]
