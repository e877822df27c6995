"""Per-step exchange latency: shim channel <-> sidecar vs raw pyzmq REQ/REP of the same bytes.

Both servers run in their own process. The client measures round trips of a
StepBegin for N requests (what the shim sends on a step that needs the sidecar
before the forward) and the StepPlan answer. The raw baseline sends the same
encoded bytes over REQ/REP to a server that answers with pre-encoded StepPlan
bytes, and pays the same client-side msgspec encode + decode.
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

ROOT = Path(__file__).resolve().parents[1]


def step_message(num_reqs: int, step: int = 0, same_ids: bool = False) -> StepBegin:
    """A steady decode step for num_reqs requests (ids omitted when unchanged, as the shim does)."""
    ids = None if same_ids else [f"cmpl-{i:06d}-0-abcdef12" for i in range(num_reqs)]
    qsl = list(range(num_reqs + 1))
    return StepBegin(step=step, batch=BatchLayout(ids, qsl, [100 + i for i in range(num_reqs)], [64] * num_reqs))


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
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=env)


def bench_raw(num_reqs: int, iters: int, run_dir: Path) -> list[float]:
    codec = Codec()
    msg = step_message(num_reqs, same_ids=True)
    reply = codec.encode(StepPlan(step=0))
    endpoint = f"ipc://{run_dir}/raw-{num_reqs}.sock"
    proc = _spawn(f"from bench.exchange import raw_server; raw_server({endpoint!r}, {reply.hex()!r})")
    sock = zmq.Context.instance().socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    samples = []
    try:
        for i in range(iters + iters // 10):
            t0 = time.perf_counter()
            sock.send(codec.encode(msg))
            codec.decode(sock.recv())
            if i >= iters // 10:  # warm-up excluded
                samples.append(time.perf_counter() - t0)
        sock.send(b"stop")
        sock.recv()
    finally:
        sock.close(0)
        proc.wait(10)
    return samples


def bench_sidecar(num_reqs: int, iters: int, run_dir: Path, hooks: str = "overlay") -> list[float]:
    """Round trips through the shim's SidecarChannel to a real `omni-sidecar serve`."""
    from proto.arena import ShmArena
    from proto.messages import Hello
    from worker_shim.channel import SidecarChannel

    endpoint = f"ipc://{run_dir}/sidecar-{num_reqs}.sock"
    proc = subprocess.Popen(
        [sys.executable, "-m", "omni_sidecar.cli", "serve", "--endpoint", endpoint, "--hooks", hooks,
         "--log-level", "WARNING"],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    arena = ShmArena.create(1 << 20)
    channel = SidecarChannel(endpoint, step_timeout_s=30)
    samples = []
    try:
        channel.handshake(
            Hello(1, 0, "bench", "none", "cpu", 0, 1, "bench", 128, "float32", 256, [arena.info()]), 30
        )
        channel.call(step_message(num_reqs), StepPlan)  # names the requests once
        msg = step_message(num_reqs, same_ids=True)
        for i in range(iters + iters // 10):
            t0 = time.perf_counter()
            channel.call(msg, StepPlan)
            if i >= iters // 10:
                samples.append(time.perf_counter() - t0)
    finally:
        channel.close()
        arena.close()
        proc.terminate()
        proc.wait(10)
    return samples
