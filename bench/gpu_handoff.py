"""Tensor handoff cost on a GPU: 16 MiB of bf16 hidden states, shim -> sidecar, per step.

Two processes, as in production: the producer (the shim's role) owns a CUDA IPC
arena of two slots, exported once; the consumer (the sidecar's role) opens it
and its events once. Per step the producer copies the hidden states into a
slot on its stream, records the slot's ready event and sends a TensorRef; the
consumer's stream waits on the event, reads the slot (a copy into its own
buffer, what a capturing hook does), records its done event and acks.

Printed per path, p50/p99 in us:
- `enqueue`: producer host time for copy + event + send (what the shim's step pays);
- `round trip`: send -> the consumer has the bytes on its side (it synchronizes its
  stream before acking, only here, to time the arrival) -> ack;
- the same for host staging through shared memory (the path of CUDA-alike devices without
  CUDA IPC, forced).
Also the open counts (must be 1 buffer + the events, once).

Usage: python -m bench.gpu_handoff [--mib 16] [--steps 300]
"""

from __future__ import annotations

import argparse
import atexit
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import msgspec
import zmq

from proto.messages import ArenaInfo
from proto.tensors import TensorRef

ROOT = Path(__file__).resolve().parents[1]


class Setup(msgspec.Struct):
    arena: ArenaInfo
    hidden_shape: list[int]


class Step(msgspec.Struct, array_like=True):
    ref: TensorRef
    event: int


def _pct(xs: list[float]) -> dict[str, float]:
    xs = sorted(xs)
    return {"p50": statistics.median(xs), "p99": xs[round(0.99 * (len(xs) - 1))], "n": len(xs)}


def consumer(endpoint: str) -> None:
    import torch

    from omni_arena.cuda_ipc import CudaIpcArena, OpenCounts
    from proto.arena import ShmArena

    sock = zmq.Context.instance().socket(zmq.PAIR)
    sock.connect(endpoint)
    setup = msgspec.msgpack.decode(sock.recv(), type=Setup)
    counts = OpenCounts()
    if setup.arena.kind == "cuda_ipc":
        arena = CudaIpcArena.attach(setup.arena, counts)
        sock.send(msgspec.msgpack.encode(arena.make_done_events()))
        device = arena.device
    else:
        arena = ShmArena.attach(setup.arena)
        sock.send(msgspec.msgpack.encode([]))
        device = torch.device("cuda", 0)
    mine = torch.empty(setup.hidden_shape, dtype=torch.bfloat16, device=device)
    while True:
        frame = sock.recv()
        if frame == b"stop":
            sock.send(msgspec.msgpack.encode({"mem": counts.mem, "events": counts.events}))
            return
        step = msgspec.msgpack.decode(frame, type=Step)
        if isinstance(arena, CudaIpcArena):
            arena.wait_ready(step.event)
            mine.copy_(arena.tensor(step.ref), non_blocking=True)
            arena.mark_done(step.event)
        else:
            view = torch.frombuffer(arena.view(step.ref), dtype=torch.bfloat16).view(step.ref.shape)
            mine.copy_(view)  # host -> device
        torch.cuda.current_stream(device).synchronize()  # timing only: the bytes are here
        sock.send(b"ack")


def run(kind: str, mib: int, steps: int) -> dict:
    import torch

    from omni_arena.cuda_ipc import CudaIpcArena, OpenCounts
    from proto.arena import ShmArena

    device = torch.device("cuda", 0)
    hidden_size = 4096
    rows = mib * (1 << 20) // (hidden_size * 2)
    hidden = torch.randn(rows, hidden_size, device=device).to(torch.bfloat16)
    nbytes = hidden.numel() * 2
    slot = (nbytes + 4095) // 4096 * 4096
    arena = CudaIpcArena.create(2 * slot, device, 2) if kind == "cuda_ipc" else ShmArena.create(2 * slot)
    run_dir = Path(tempfile.mkdtemp(prefix="omni-handoff-"))
    atexit.register(shutil.rmtree, run_dir, True)  # its socket: nothing left behind
    endpoint = f"ipc://{run_dir}/h.sock"
    sock = zmq.Context.instance().socket(zmq.PAIR)
    sock.bind(endpoint)
    proc = subprocess.Popen([sys.executable, "-m", "bench.gpu_handoff", "--consumer", endpoint], cwd=ROOT)
    counts = OpenCounts()
    try:
        sock.send(msgspec.msgpack.encode(Setup(arena.info(), [rows, hidden_size])))
        done = msgspec.msgpack.decode(sock.recv(), type=list[bytes])
        if isinstance(arena, CudaIpcArena):
            arena.open_peer_done(done, counts)
        enqueue, round_trip = [], []
        for i in range(steps):
            k = i % 2
            ref = TensorRef(0, k * slot, nbytes, [rows, hidden_size], "bfloat16")
            torch.cuda.synchronize(device)  # isolate steps from each other (not part of the cost)
            t0 = time.perf_counter()
            if isinstance(arena, CudaIpcArena):
                arena.wait_done(k)
                arena.tensor(ref).copy_(hidden, non_blocking=True)
                event = arena.mark_ready(k)
            else:
                torch.frombuffer(arena.view(ref), dtype=torch.bfloat16).view(ref.shape).copy_(hidden)
                event = -1
            sock.send(msgspec.msgpack.encode(Step(ref, event)))
            t1 = time.perf_counter()
            sock.recv()
            t2 = time.perf_counter()
            if i >= 10:  # warm-up
                enqueue.append((t1 - t0) * 1e6)
                round_trip.append((t2 - t0) * 1e6)
        sock.send(b"stop")
        consumer_opens = msgspec.msgpack.decode(sock.recv())
    finally:
        proc.wait(30)
        sock.close(0)
    return {"kind": kind, "mib": nbytes / (1 << 20), "enqueue_us": _pct(enqueue),
            "round_trip_us": _pct(round_trip), "consumer_opens": consumer_opens,
            "producer_opens": {"mem": counts.mem, "events": counts.events}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=16)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument("--consumer", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.consumer:
        consumer(args.consumer)
        return
    results = [run(kind, args.mib, args.steps) for kind in ("cuda_ipc", "shm")]
    for r in results:
        print(f"{r['kind']:9s} {r['mib']:.0f} MiB bf16: enqueue p50 {r['enqueue_us']['p50']:.1f} us "
              f"p99 {r['enqueue_us']['p99']:.1f} | round trip p50 {r['round_trip_us']['p50']:.1f} us "
              f"p99 {r['round_trip_us']['p99']:.1f} | opens consumer {r['consumer_opens']} "
              f"producer {r['producer_opens']}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
