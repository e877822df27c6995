"""A stage's sidecar: an `omni-sidecar serve` process started and supervised here, or one attached to.

Started through the sidecar's own CLI (never imported: the sidecar stays a separate, vLLM-free
program). A supervised sidecar that exits is started again on the same endpoint (its stage's
requests in flight fail at once, what it held of them being gone; once it answers, its stage's
engine is asked to connect to it at once), unless a hot upgrade (`omni-sidecar upgrade`) handed it
over to a successor: that one, answering at the endpoint, is adopted (stopped with the server;
started again as before if it dies). An attached one belongs
to whoever started it (compose, systemd) and is only watched: found not answering, its stage's
requests in flight fail at once, and its engine reconnects once one answers there again.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Awaitable, Callable

from vllm.logger import init_logger

from omni_serve.config import SidecarSpec
from omni_serve.stages.link import AsyncSidecarClient
from proto.capabilities import HookNeeds

logger = init_logger(f"vllm.{__name__}")  # under vLLM's logger: its handler, format and VLLM_LOGGING_LEVEL
READY_TIMEOUT_S = 90.0
RESTART_PAUSE_S = 0.5
# An attached sidecar is asked this often whether it answers; unanswered this many times in a row
# (each within CHECK_TIMEOUT_S), it is taken as gone: a hot upgrade's hand-over is a few ms, a
# busy sidecar answers between its steps.
CHECK_EVERY_S = 0.5
CHECK_TIMEOUT_S = 1.0
CHECK_MISSES = 3
STOP_TIMEOUT_S = 15.0


class SidecarProcess:
    def __init__(self, stage: str, spec: SidecarSpec, run_dir: Path) -> None:
        self.stage = stage
        self.spec = spec
        self.endpoint = spec.endpoint or f"ipc://{run_dir}/{stage}.sock"
        self.log_path = run_dir / f"{stage}-sidecar.log"
        self.proc: subprocess.Popen | None = None
        self.successor: int = 0  # the pid a hot upgrade handed the endpoint to (not our child)
        self.restarts = 0
        self.stopping = False
        # Called once a sidecar started again answers: its stage's engine takes it up now (an idle
        # engine's shim would only at its next step, and the requests the loss failed wait for that).
        self.on_restart: Callable[[], Awaitable[None]] | None = None
        # Called when a supervised sidecar is found dead, with what happened: its stage's requests in
        # flight fail now (what it held of them is gone), not when they give up waiting on it.
        self.on_lost: Callable[[str], None] | None = None
        self.restarting = False  # found dead, until the one started again answers and its engine was told
        self._watch: asyncio.Task | None = None

    def command(self) -> list[str]:
        cmd = [sys.executable, "-m", "omni_sidecar.cli", "serve", "--endpoint", self.endpoint, "--hooks", self.spec.hooks]
        for key, value in self.spec.options.items():
            cmd += ["--hook-option", f"{key}={value}"]
        return cmd

    def _spawn(self) -> None:
        log = open(self.log_path, "a")
        self.proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        log.close()

    async def start(self) -> None:
        if not self.spec.attach:
            if not self.spec.hooks:
                raise ValueError(f"stage {self.stage}: its sidecar needs hooks (or attach = true and an endpoint)")
            self._spawn()
        await self.wait_ready()
        self._watch = asyncio.create_task(self._watch_attached() if self.spec.attach else self._supervise())
        logger.info("%s sidecar %s at %s", self.stage, "attached" if self.spec.attach else
                    f"started (pid {self.proc.pid})", self.endpoint)

    async def wait_ready(self, timeout_s: float = READY_TIMEOUT_S) -> None:
        link = AsyncSidecarClient(self.endpoint, timeout_s=1.0)
        deadline = time.monotonic() + timeout_s
        try:
            while time.monotonic() < deadline:
                if self.proc is not None and self.proc.poll() is not None:
                    raise RuntimeError(f"the {self.stage} sidecar exited with {self.proc.returncode} while starting "
                                       f"(see {self.log_path})")
                if await link.ping():
                    return
                await asyncio.sleep(0.05)
        finally:
            link.close()
        raise RuntimeError(f"no {self.stage} sidecar answered at {self.endpoint} within {timeout_s:.0f}s")

    async def needs(self) -> HookNeeds:
        """What the sidecar's hook set needs of the shim (its engine's settings follow from it)."""
        link = AsyncSidecarClient(self.endpoint)
        try:
            return (await link.status()).needs
        finally:
            link.close()

    async def _supervise(self) -> None:
        while not self.stopping:
            await asyncio.sleep(0.2)
            if self.stopping or self.running:
                continue
            successor = await self._successor()
            if successor:
                logger.info("the %s sidecar at %s was handed over to pid %d (hot upgrade); supervising that one",
                            self.stage, self.endpoint, successor)
                self.proc, self.successor = None, successor
                continue
            how = f"pid {self.proc.pid}, status {self.proc.returncode}" if self.proc else f"pid {self.successor}"
            logger.error("the %s sidecar exited (%s); starting it again", self.stage, how)
            self.restarting = True
            if self.on_lost is not None:
                self.on_lost(f"its sidecar exited ({how}) with the request in flight; it is being started again")
            await asyncio.sleep(RESTART_PAUSE_S)
            self.restarts += 1
            self.successor = 0
            self._spawn()
            try:
                await self.wait_ready()
                if self.on_restart is not None:
                    await self.on_restart()
            except RuntimeError as exc:
                logger.error("%s", exc)
            finally:
                self.restarting = False

    async def _watch_attached(self) -> None:
        """An attached sidecar belongs to whoever started it (compose restarts it): found gone, its
        stage's requests in flight fail now; once one answers at the endpoint again, its engine is
        asked to take it up at once."""
        link = AsyncSidecarClient(self.endpoint, timeout_s=CHECK_TIMEOUT_S)
        misses = 0
        try:
            while not self.stopping:
                await asyncio.sleep(CHECK_EVERY_S)
                if await link.ping():
                    misses = 0
                    if self.restarting:
                        logger.info("the attached %s sidecar at %s answers again; its engine takes it up",
                                    self.stage, self.endpoint)
                        self.restarts += 1
                        if self.on_restart is not None:
                            await self.on_restart()
                        self.restarting = False
                    continue
                misses += 1
                if misses == CHECK_MISSES and not self.restarting:
                    logger.error("the attached %s sidecar at %s stopped answering: its requests in flight fail; "
                                 "its stage serves again once whoever runs it has it answering there", self.stage,
                                 self.endpoint)
                    self.restarting = True
                    if self.on_lost is not None:
                        self.on_lost("its sidecar stopped answering with the request in flight")
        finally:
            link.close()

    @property
    def running(self) -> bool:
        if self.proc is not None:
            return self.proc.poll() is None
        return bool(self.successor) and os.path.exists(f"/proc/{self.successor}")

    async def _successor(self) -> int:
        """The pid of another sidecar that answers at the endpoint (0: none)."""
        link = AsyncSidecarClient(self.endpoint, timeout_s=1.0)
        try:
            pid = (await link.status()).pid
        except Exception:  # nothing there, or not answering: no successor
            return 0
        finally:
            link.close()
        mine = self.proc.pid if self.proc is not None else self.successor
        return pid if pid and pid != mine else 0

    async def stop(self) -> None:
        self.stopping = True
        if self._watch is not None:
            self._watch.cancel()
        if self.proc is None and self.successor:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.successor, signal.SIGTERM)
            deadline = time.monotonic() + STOP_TIMEOUT_S
            while self.running and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            return
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        deadline = time.monotonic() + STOP_TIMEOUT_S
        while self.proc.poll() is None and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    @property
    def alive(self) -> bool:
        return not self.restarting and (self.spec.attach or self.running)


def socket_dir(run_dir: Path) -> Path:
    """The sidecars accept only a directory no one else can enter."""
    run_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(run_dir, 0o700)
    return run_dir
