"""Starting real sidecar processes and engine jobs from tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tests.support.engine_forks import EngineForks

ROOT = Path(__file__).resolve().parents[2]
ENGINE_JOB = Path(__file__).with_name("engine_job.py")
# Set by tests/conftest.py for the test session (engine_forks.py); None elsewhere (bench, deploy/gpu).
ENGINE_FORKS: EngineForks | None = None


def child_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


class SidecarProcess:
    """`omni-sidecar serve` in a child process, ready when it answers a ping."""

    def __init__(
        self, endpoint: str, hooks: str, log_path: Path, options: list[str] = (), env: dict | None = None,
        extra_args: list[str] = (),
    ) -> None:
        self.endpoint = endpoint
        self.log_path = log_path
        self._log = open(log_path, "w")
        extra = [a for opt in options for a in ("--hook-option", opt)]
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "omni_sidecar.cli", "serve", "--endpoint", endpoint,
             "--hooks", hooks, "--log-level", "INFO", *extra, *extra_args],
            stdout=self._log, stderr=subprocess.STDOUT, env=child_env(**(env or {})),
        )
        self._wait_ready()

    def _wait_ready(self, timeout_s: float = 60.0) -> None:
        from omni_sidecar.client import SidecarUnavailable, wait_ready

        try:
            wait_ready(self.endpoint, timeout_s, self.proc)
        except SidecarUnavailable as exc:
            raise RuntimeError(f"{exc}:\n{self.log_path.read_text()}") from None

    def status(self):
        from omni_sidecar.client import SidecarClient

        with SidecarClient(self.endpoint) as c:
            return c.status()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self._log.close()


def run_script(argv: list[str], log_path: Path, timeout_s: float, **env: str) -> int:
    """`python ARGV...` with the suite's environment (and `env`), its output in log_path; its exit
    status. In a test session a fork of a Python with vLLM imported (engine_forks.py)."""
    if ENGINE_FORKS is not None:
        return ENGINE_FORKS.run(argv, child_env(**env), log_path, timeout_s)
    with open(log_path, "w") as log:
        return subprocess.run([sys.executable, *argv], stdout=log, stderr=subprocess.STDOUT, env=child_env(**env),
                              timeout=timeout_s).returncode


def run_engine(job: dict, workdir: Path, name: str, timeout_s: float = 600, script: Path = ENGINE_JOB) -> dict:
    job = {**job, "workdir": str(workdir), "name": name}
    job_path = workdir / f"{name}.job.json"
    result_path = workdir / f"{name}.result.json"
    log_path = workdir / f"{name}.log"
    job_path.write_text(json.dumps(job))
    rc = run_script([str(script), str(job_path), str(result_path)], log_path, timeout_s)
    if not result_path.exists():
        raise RuntimeError(f"engine job {name} died (rc={rc}):\n{log_path.read_text()[-4000:]}")
    result = json.loads(result_path.read_text())
    result["log_path"] = str(log_path)
    return result


def write_embeds(directory: Path, lens: list[int], hidden: int, seed: int = 7) -> list[str]:
    """Random prompt embeddings E (one .npy per length), shared by the CPU tests and the GPU checks."""
    import numpy as np

    rng = np.random.default_rng(seed)
    files = []
    for i, n in enumerate(lens):
        path = Path(directory) / f"embeds{i}.npy"
        np.save(path, (rng.standard_normal((n, hidden)) * 0.5).astype(np.float32), allow_pickle=False)
        files.append(str(path))
    return files
