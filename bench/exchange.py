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
from proto.messages import StepBegin, StepPlan
from proto.packed import packed_layout
from proto.version import PROTOCOL_MAJOR, PROTOCOL_MINOR

ROOT = Path(__file__).resolve().parents[1]


def step_message(num_reqs: int, step: int = 0, same_ids: bool = False) -> StepBegin:
    """A steady decode step for num_reqs requests (ids omitted when unchanged, as the shim does)."""
    ids = None if same_ids else [f"cmpl-{i:06d}-0-abcdef12" for i in range(num_reqs)]
    qsl = list(range(num_reqs + 1))
    computed, prefill = [100 + i for i in range(num_reqs)], [64] * num_reqs
    return StepBegin(step=step, batch=packed_layout(ids, qsl, computed, prefill))


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
        from worker_shim.wire.channel import SidecarChannel
        from worker_shim.config import RingConfig

        endpoint = f"ipc://{run_dir}/sidecar-{num_reqs}-{'ring' if ring else 'zmq'}.sock"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "omni_sidecar.cli", "serve", "--endpoint", endpoint, "--hooks", "overlay",
             "--log-level", "WARNING"],
            cwd=ROOT, env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))},
        )
        self.arena: ShmArena | None = None
        self.channel: SidecarChannel | None = None
        try:  # a failed start stops what it started (a refused handshake must not leave a sidecar running)
            wait_ready(endpoint, 60, self.proc)
            self.arena = ShmArena.create(1 << 20)
            self.channel = SidecarChannel(endpoint, step_timeout_s=30, ring=RingConfig.from_env() if ring else
                                          RingConfig(enabled=False))
            self.channel.handshake(Hello(PROTOCOL_MAJOR, PROTOCOL_MINOR, "bench", "none", "cpu", 0, 1, "bench", 128,
                                         "float32", 256, [self.arena.info()]), 30)
            if ring and self.channel.rings is None:
                raise RuntimeError("the sidecar did not accept the shared-memory rings")
            self.channel.call(step_message(num_reqs), StepPlan)  # names the requests once
        except BaseException:
            self.close()
            raise
        self.msg = step_message(num_reqs, same_ids=True)

    def round_trip(self) -> None:
        self.channel.call(self.msg, StepPlan)

    def close(self) -> None:
        if self.channel is not None:
            self.channel.close()
        if self.arena is not None:
            self.arena.close()
        self.proc.terminate()
        self.proc.wait(15)


PATHS = ("raw", "ring", "zmq")


def interleaved(num_reqs: int, iters: int, run_dir: Path, block: int = 250) -> dict[str, list[float]]:
    """All three paths alive at once, measured in alternating blocks so host drift hits them alike."""
    starts = {"raw": lambda: RawClient(num_reqs, run_dir),
              "ring": lambda: SidecarClientBench(num_reqs, run_dir, ring=True),
              "zmq": lambda: SidecarClientBench(num_reqs, run_dir, ring=False)}
    clients: dict[str, RawClient | SidecarClientBench] = {}
    samples: dict[str, list[float]] = {name: [] for name in starts}
    try:
        for name, start in starts.items():  # one at a time: a failed start closes those already up
            clients[name] = start()
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


def _median_row(runs: list[dict]) -> dict:
    """One table row from several runs' rows of the same request count: medians of each figure."""
    keys = ("raw_p50", "raw_p99", "ring_p50", "ring_p99", "zmq_p50", "zmq_p99")
    row = {k: statistics.median(r[k] for r in runs) for k in keys}
    row.update(requests=runs[0]["requests"], iters=runs[0]["iters"], runs=len(runs),
               ratio_p50=row["ring_p50"] / row["raw_p50"], zmq_ratio_p50=row["zmq_p50"] / row["raw_p50"])
    return row


def _spread(per_n: dict[int, list[dict]], date: str) -> str:
    parts = []
    for n, runs in per_n.items():
        p50s, p99s = [r["ring_p50"] for r in runs], [r["ring_p99"] for r in runs]
        parts.append(f"{n}: p50 {min(p50s):.1f}-{max(p50s):.1f}, p99 {min(p99s):.1f}-{max(p99s):.1f}")
    return (f"Table: medians of {len(next(iter(per_n.values())))} runs of `python -m bench.exchange` ({date}); "
            f"sidecar ring spread over the runs (us, min-max) by requests: " + "; ".join(parts) + ".")


def main() -> None:
    """Part (a) alone, several runs: prints each and rewrites section (a) of `make bench`'s report
    (.bench/cpu.md) with the medians and their spread (the rest of the report and its plots stay)."""
    import argparse
    import re
    import tempfile

    from bench.__main__ import exchange, exchange_section

    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--iters", type=int, default=3000, help="round trips per path, request count and run")
    ap.add_argument("--markdown", default=str(ROOT / ".bench" / "cpu.md"), help="`make bench`'s report")
    ap.add_argument("--no-write", action="store_true", help="print only")
    args = ap.parse_args()
    per_n: dict[int, list[dict]] = {}
    for run in range(args.runs):
        print(f"run {run + 1} of {args.runs}", flush=True)
        with tempfile.TemporaryDirectory(prefix="omni-bench-") as run_dir:  # its sockets and logs
            rows, _ = exchange(Path(run_dir), args.iters)
        for row in rows:
            per_n.setdefault(row["requests"], []).append(row)
    rows = [_median_row(runs) for runs in per_n.values()]
    spread = _spread(per_n, time.strftime("%Y-%m-%d"))
    print(spread)
    if args.no_write:
        return
    path = Path(args.markdown)
    if not path.exists():
        raise SystemExit(f"{path} does not exist: run `make bench` first")
    text = path.read_text()
    old = re.search(r"^## \(a\).*?(?=^## \(b\))", text, flags=re.S | re.M)
    if old is None:
        raise SystemExit(f"{path} has no section (a) followed by (b): run `make bench`")
    plots = re.findall(r"^!\[exchange latency\]\((.*?)\)$", old.group(0), flags=re.M)
    text = text[: old.start()] + "\n".join(exchange_section(rows, plots, spread)) + "\n" + text[old.end():]
    path.write_text(text)
    print(f"rewrote section (a) of {path}")


if __name__ == "__main__":
    main()
