"""Per-step exchange latency: shim channel <-> sidecar vs raw pyzmq REQ/REP of the same bytes.

Every server runs in its own process. The client measures round trips of a
StepBegin for N requests (what the shim sends on a step that needs the sidecar
before the forward) and the StepPlan answer, through the shim's real
SidecarChannel to a real `omni-sidecar serve`: once with the shared-memory rings
negotiated (the default), once with rings off (ZeroMQ only, OMNI_SIDECAR_RING=0).
The raw baseline sends the same encoded bytes over REQ/REP to a server that
answers with pre-encoded StepPlan bytes, and pays the same client-side msgspec
encode + decode.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import zmq

from proto.codec import Codec
from proto.messages import BatchLayout, StepBegin, StepPlan
from proto.packed import packed_layout

ROOT = Path(__file__).resolve().parents[1]


def step_message(num_reqs: int, step: int = 0, same_ids: bool = False, packed: bool = True) -> StepBegin:
    """A steady decode step for num_reqs requests (ids omitted when unchanged, as the shim does);
    `packed`: the layout as the shim sends it to a sidecar of protocol 1.6 or later."""
    ids = None if same_ids else [f"cmpl-{i:06d}-0-abcdef12" for i in range(num_reqs)]
    qsl = list(range(num_reqs + 1))
    computed, prefill = [100 + i for i in range(num_reqs)], [64] * num_reqs
    if packed:
        return StepBegin(step=step, packed=packed_layout(ids, qsl, computed, prefill))
    return StepBegin(step=step, batch=BatchLayout(ids, qsl, computed, prefill))


def percentiles(samples_s: list[float]) -> dict[str, float]:
    us = sorted(x * 1e6 for x in samples_s)
    return {"p50": statistics.median(us), "p99": us[round(0.99 * (len(us) - 1))], "n": len(us)}


def raw_server(endpoint: str, reply_hex: str) -> None:
    reply = bytes.fromhex(reply_hex)
    sock = zmq.Context.instance().socket(zmq.REP)
    sock.bind(endpoint)
    while True:
        if sock.recv() == b"stop":
            sock.send(b"")
            return
        sock.send(reply)


def _spawn(code: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    return subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=env)


class RawClient:
    """pyzmq REQ/REP against a server that answers pre-encoded StepPlan bytes."""

    def __init__(self, num_reqs: int, run_dir: Path) -> None:
        self.codec = Codec()
        self.msg = step_message(num_reqs, same_ids=True)
        reply = self.codec.encode(StepPlan(step=0))
        endpoint = f"ipc://{run_dir}/raw-{num_reqs}.sock"
        self.proc = _spawn(f"from bench.exchange import raw_server; raw_server({endpoint!r}, {reply.hex()!r})")
        self.sock = zmq.Context.instance().socket(zmq.REQ)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)

    def round_trip(self) -> None:
        self.sock.send(self.codec.encode(self.msg))
        self.codec.decode(self.sock.recv())

    def close(self) -> None:
        self.sock.send(b"stop")
        self.sock.recv()
        self.sock.close(0)
        self.proc.wait(10)


class SidecarClientBench:
    """The shim's SidecarChannel against a real `omni-sidecar serve --hooks overlay`."""

    def __init__(self, num_reqs: int, run_dir: Path, ring: bool = True) -> None:
        from omni_sidecar.client import wait_ready
        from proto.arena import ShmArena
        from proto.messages import Hello
        from worker_shim.channel import SidecarChannel
        from worker_shim.config import RingConfig

        endpoint = f"ipc://{run_dir}/sidecar-{num_reqs}-{'ring' if ring else 'zmq'}.sock"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "omni_sidecar.cli", "serve", "--endpoint", endpoint, "--hooks", "overlay",
             "--log-level", "WARNING"],
            cwd=ROOT, env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))},
        )
        wait_ready(endpoint, 60, self.proc)
        self.arena = ShmArena.create(1 << 20)
        self.channel = SidecarChannel(endpoint, step_timeout_s=30, ring=RingConfig.from_env() if ring else
                                      RingConfig(enabled=False))
        self.channel.handshake(
            Hello(1, 0, "bench", "none", "cpu", 0, 1, "bench", 128, "float32", 256, [self.arena.info()]), 30
        )
        if ring and not self.channel.ring_active:
            raise RuntimeError("the sidecar did not accept the shared-memory rings")
        self.channel.call(step_message(num_reqs), StepPlan)  # names the requests once
        self.msg = step_message(num_reqs, same_ids=True)

    def round_trip(self) -> None:
        self.channel.call(self.msg, StepPlan)

    def close(self) -> None:
        self.channel.close()
        self.arena.close()
        self.proc.terminate()
        self.proc.wait(15)


PATHS = ("raw", "ring", "zmq")


def interleaved(num_reqs: int, iters: int, run_dir: Path, block: int = 250) -> dict[str, list[float]]:
    """All three paths alive at once, measured in alternating blocks so host drift hits them alike."""
    clients = {"raw": RawClient(num_reqs, run_dir), "ring": SidecarClientBench(num_reqs, run_dir, ring=True),
               "zmq": SidecarClientBench(num_reqs, run_dir, ring=False)}
    samples: dict[str, list[float]] = {name: [] for name in clients}
    try:
        for client in clients.values():  # warm-up
            for _ in range(200):
                client.round_trip()
        while len(samples["raw"]) < iters:
            for name, client in clients.items():
                out = samples[name]
                time.sleep(0.01)  # past the ring sidecar's spin window: it must not compete with others' blocks
                for _ in range(block):
                    t0 = time.perf_counter()
                    client.round_trip()
                    out.append(time.perf_counter() - t0)
    finally:
        for client in clients.values():
            client.close()
    return samples
