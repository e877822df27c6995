"""An `omni-serve` process for the e2e tests, and HTTP calls to it."""

from __future__ import annotations

import contextlib
import http.client
import json
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

from tests.support.procs import ROOT, child_env

START_TIMEOUT_S = 400
# A stage engine on the tiny models (a pipeline config's `engine` table, without its braces).
TINY_ENGINE = ('max_model_len = 128, max_num_seqs = 8, max_num_batched_tokens = 64, dtype = "float32", '
               'enforce_eager = true, seed = 0, kv_cache_memory_bytes = 16777216')


# The server binds its port a minute after it is chosen (its engines start first): a port the kernel
# hands out meanwhile (any port-0 bind: a test's web server, vLLM's own sockets) must not be it, so
# it comes from below Linux's ephemeral range (32768 and up).
PORTS = range(20000, 32768)


def free_port() -> int:
    rng = random.Random()
    while True:
        port = rng.choice(PORTS)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port


class Server:
    def __init__(self, work: Path, config: Path, env: dict[str, str] | None = None, args: tuple[str, ...] = ()) -> None:
        self.port = free_port()
        self.run_dir = work / "run"
        self.log = work / "server.log"
        self.codes_log = work / "codes.jsonl"  # each request's codes, as the talker made them (--codes-log)
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "omni_serve", "--pipeline", str(config), "--port", str(self.port),
                 "--run-dir", str(self.run_dir), "--uvicorn-log-level", "warning", "--codes-log", str(self.codes_log),
                 *args],
                stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=child_env(**(env or {})))
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"omni-serve exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                if self.get("/health")[0] == 200:
                    return
            except OSError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"omni-serve did not come up within {START_TIMEOUT_S}s:\n{self.tail()}")
            time.sleep(0.5)

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]

    def connection(self, timeout: float = 120.0) -> http.client.HTTPConnection:
        return http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)

    def get(self, path: str) -> tuple[int, bytes]:
        return self._bodiless("GET", path)

    def delete(self, path: str) -> tuple[int, bytes]:
        return self._bodiless("DELETE", path)

    def _bodiless(self, method: str, path: str) -> tuple[int, bytes]:
        conn = self.connection(5.0)
        try:
            conn.request(method, path)
            resp = conn.getresponse()
            return resp.status, resp.read()
        finally:
            conn.close()

    def upload_voice(self, clip: bytes | None, filename: str = "clone.wav", **fields: str) -> tuple[int, dict]:
        """vllm-omni's voice upload: a multipart form, as its clients send it."""
        import httpx

        files = {"audio_sample": (filename, clip, "audio/wav")} if clip is not None else None
        answer = httpx.post(f"http://127.0.0.1:{self.port}/v1/audio/voices", data=fields, files=files, timeout=60)
        return answer.status_code, answer.json()

    def post(self, body: bytes | dict, path: str = "/v1/audio/speech") -> tuple[int, bytes, str]:
        conn = self.connection()
        try:
            data = body if isinstance(body, bytes) else json.dumps(body).encode()
            conn.request("POST", path, body=data, headers={"Content-Type": "application/json"})
            resp = conn.getresponse()
            return resp.status, resp.read(), resp.getheader("Content-Type", "")
        finally:
            conn.close()

    def endpoint(self, stage: str) -> str:
        return f"ipc://{self.run_dir}/{stage}.sock"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def live_requests(endpoint: str) -> tuple[int, int]:
    """(requests admitted, requests finished) over a stage sidecar's sessions."""
    from omni_sidecar.client import SidecarClient

    with SidecarClient(endpoint) as client:
        status = client.status()
    return sum(s.new_requests for s in status.sessions), sum(s.finished_requests for s in status.sessions)


def wait_all_finished(server: Server, stages: tuple[str, ...], timeout_s: float = 30.0) -> None:
    """Until every request admitted in the stages' sidecars has finished there."""
    deadline = time.monotonic() + timeout_s
    while True:
        counts = {stage: live_requests(server.endpoint(stage)) for stage in stages}
        if all(new == done for new, done in counts.values()):
            return
        assert time.monotonic() < deadline, f"requests still live in the sidecars: {counts}"
        time.sleep(0.1)


def metric(server: Server, name: str) -> float:
    _, text = server.get("/metrics")
    for line in text.decode().splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    raise AssertionError(f"{name} not in /metrics")


@contextlib.contextmanager
def serving(work: Path, config: Path, env: dict[str, str] | None = None, args: tuple[str, ...] = ()) -> Iterator[Server]:
    """A server for a test module (`env`: its environment's changes, `args`: more omni-serve options);
    stopped cleanly after, its sidecars' sockets gone."""
    srv = Server(work, config, env, args)
    try:
        yield srv
    finally:
        srv.stop()
    assert srv.proc.returncode == 0, srv.tail()
    assert not list(srv.run_dir.glob("*.sock")), "the sidecars' sockets were left behind"
