"""The shim's host cost per step, measured through its real link and rings against a real sidecar.

What a decode step costs the vLLM worker's thread in the shim: `note_finished` + `begin_step`
(StepStart) + `pre_forward` (no exchange here) + `end_step` (whatever the step sends), with
vLLM's batch faked (N requests, one decode row each, numpy arrays as V2 keeps them). The
"forward" between steps (`--forward-ms`, default 2.5 ms: the tiny model's CUDA-graph step on an
H200) spins on the worker thread (or sleeps, `--forward-sleep`); the sidecar spins out and sleeps
as it would, and kicks are paid where they would be. Two figures per step: the worker thread's CPU time in those calls (the host cost;
other processes on a small host do not inflate it: on a one-CPU VM the sidecar's spin shares the
core) and their wall time. Timings only: nothing here passes or fails.

Hook sets measured side by side, in alternating blocks:
- `passthrough`: reads nothing per step (no hidden states, no process_model_output): a step that
  brings nothing new sends only the fixed-size StepTick (docs/ARCHITECTURE.md, Step sequence).
- `observe`: pass-through hooks that override `process_model_output` (so every step's layout must
  reach them): the full StepEnd every step: what a step costs when its hooks must see the layout.
- `passthrough-inproc`, `observe-inproc`: the same link driving the same hook sets in this process
  (bench/inproc.py: the sidecar's session called directly, no socket or ring): what a step costs
  the worker's thread without the process boundary (the hooks' own work included, which the
  sidecar does in its own process).
- `omni`, `omni-inproc` (only with `--only`): the omni set working every step (extra kwargs: each
  request's state as `runtime_additional_information`, a plan awaited and read every step; the
  step's hidden rows sent at its end), with the link's plan read and StepEnd on the worker's thread;
  `omni-nostretch`: the same with the sidecar's polling window kept fixed (proto/transport.py, SpinWindow);
  `omni-gc-anywhere`: the same with the sidecar's cycle collector left to the interpreter
  (omni_sidecar/serve/collector.py: by default it runs between steps).
  Give `--between-ms` (sampling and scheduling) so the sidecar's work can overlap it as in vLLM.

    python -m bench.step_cost [--steps 3000] [--requests 64] [--forward-ms 2.5] [--between-ms 0]
"""

from __future__ import annotations

import argparse
import atexit
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import msgspec
import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from proto.messages import Hello  # noqa: E402
from proto.version import PROTOCOL_MAJOR, PROTOCOL_MINOR  # noqa: E402

HOOK_SETS = {"passthrough": "passthrough", "observe": "bench.step_cost_hooks:ObservingPassThrough",
             "passthrough-inproc": "passthrough", "observe-inproc": "bench.step_cost_hooks:ObservingPassThrough"}
OMNI_SETS = {"omni": "omni", "omni-inproc": "omni", "omni-nostretch": "omni", "omni-gc-anywhere": "omni"}  # measured when named in --only
HOOK_OPTIONS = {"omni": {"extra_kwargs": "1"}}  # by hook set spec
# By name: `omni-nostretch`'s sidecar keeps its polling window fixed (proto/transport.py, SpinWindow), so it
# sleeps through every quiet spell longer than --ring-spin-us: the shim's kicks and wake-ups, side by side.
# `omni-gc-anywhere`'s sidecar leaves Python's cycle collector to run wherever an allocation trips it,
# inside a step too (omni_sidecar/serve/collector.py): the shim's waits on those pauses, side by side.
SIDECAR_ARGS = {"omni-nostretch": ["--ring-spin-max-us", "0"], "omni-gc-anywhere": ["--no-gc-between-steps"]}
INPROC = "-inproc"  # a name ending so runs its hook set in this process
BLOCK = 250  # steps per block; hook sets alternate block by block
HELLO = Hello(PROTOCOL_MAJOR, PROTOCOL_MINOR, "bench", "none", "cpu", 0, 1, "m", 8, "float32", 1024, [], pid=os.getpid())


def _start_sidecar(endpoint: str, hooks: str, args: list[str] | None = None) -> subprocess.Popen:
    from omni_sidecar.client import wait_ready

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    options = [arg for k, v in HOOK_OPTIONS.get(hooks, {}).items() for arg in ("--hook-option", f"{k}={v}")]
    proc = subprocess.Popen([sys.executable, "-m", "omni_sidecar.cli", "serve", "--endpoint", endpoint, "--hooks",
                             hooks, *options, *(args or []), "--log-level", "WARNING"], cwd=ROOT, env=env)
    wait_ready(endpoint, 60, proc)
    return proc


def _request(req_id: str) -> SimpleNamespace:
    """A request as vLLM hands it over; the shim watches its length (max_tokens) every step."""
    return SimpleNamespace(req_id=req_id, prompt_token_ids=[1, 2, 3], prompt_len=3,
                           sampling_params=SimpleNamespace(extra_args=None, stop_token_ids=[], eos_token_id=2,
                                                           max_tokens=1 << 20))


def decode_state(req_ids: list[str], step: int, hidden: Any = None) -> SimpleNamespace:
    """A steady decode step as V2's InputBatch holds it: one row per request (also the structural
    tests' step); `hidden`: the forward's hidden rows, for hooks that read them."""
    n = len(req_ids)
    batch = SimpleNamespace(req_ids=req_ids, num_tokens=n, query_start_loc_np=np.arange(n + 1, dtype=np.int32),
                            num_computed_tokens_np=np.full(n, 3 + step, dtype=np.int32),
                            prefill_len_np=np.full(n, 3, dtype=np.int32), num_tokens_after_padding=n)
    return SimpleNamespace(input_batch=batch, hidden_states=hidden)


def _forward(seconds: float, spin: bool) -> None:
    """The forward's time on the worker thread: spinning, as a thread that waits for the device with
    CUDA's default (spin) synchronisation keeps its CPU; or sleeping (`--forward-sleep`), where a
    VM's CPU goes idle and the next step starts with cold caches."""
    if not spin:
        time.sleep(seconds)
        return
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


class ShimUnderTest:
    """One link + connection (rings on) to its own sidecar process."""

    def __init__(self, run_dir: Path, name: str, hooks: str, num_reqs: int) -> None:
        self.sidecar: subprocess.Popen | None = None
        self.link = self._link(run_dir, name, hooks)  # length finishes watched, as in the worker
        self.req_ids = [f"cmpl-{i:06d}-0-abcdef12" for i in range(num_reqs)]
        self.link.note_new([_request(r) for r in self.req_ids])
        self.step = 0
        # Hooks that read hidden states get the forward's rows; a plan's tensors go to the model's device.
        self.hidden = torch.randn(num_reqs, HELLO.hidden_size) if self.link.needs.hidden_states else None
        self.model = torch.nn.Linear(1, 1)
        self.samples: list[float] = []  # wall time in the shim's calls
        self.cpu_samples: list[float] = []  # CPU time of this thread in them (what other processes do not inflate)

    def _link(self, run_dir: Path, name: str, hooks: str):
        from worker_shim.config import RingConfig
        from worker_shim.wire.connection import SidecarConnection
        from worker_shim.step.link import SidecarLink

        endpoint = f"ipc://{run_dir}/{name}.sock"
        self.sidecar = _start_sidecar(endpoint, hooks, SIDECAR_ARGS.get(name))

        def connect(endpoint: str = endpoint, resume_token: str = "") -> SidecarConnection:
            return SidecarConnection(endpoint, 10.0, msgspec.structs.replace(HELLO, resume_token=resume_token),
                                     1 << 16, 2, arena_prefix=f"omni-bench-{name}", ring=RingConfig())

        try:
            conn = connect()
            conn.connect(10.0)
        except BaseException:
            self.sidecar.terminate()
            self.sidecar.wait(10)
            raise
        return SidecarLink(connect, conn)

    def run(self, steps: int, forward_s: float, spin: bool = True, between_s: float = 0.0) -> None:
        link, no_finishes = self.link, set()
        wall, cpu = time.perf_counter, time.thread_time
        for _ in range(steps):
            state = decode_state(self.req_ids, self.step, self.hidden)
            c0, t0 = cpu(), wall()
            link.note_finished(no_finishes, None)
            link.begin_step()
            link.pre_forward(state.input_batch, self.model)
            t1, c1 = wall(), cpu()
            _forward(forward_s, spin)  # not the shim's cost
            c2, t2 = cpu(), wall()
            link.end_step(state)
            t3, c3 = wall(), cpu()
            self.samples.append((t1 - t0) + (t3 - t2))
            self.cpu_samples.append((c1 - c0) + (c3 - c2))
            self.step += 1
            if between_s:
                _forward(between_s, spin)  # sampling and scheduling: not the shim's cost either

    def close(self) -> dict:
        try:
            self.link.note_finished(set(self.req_ids), None)
            self.link.begin_step()
            self.link.end_step(None)
            stats = self.link.stats()
            session = self._session_status()
        finally:  # the sidecar and the arenas go whatever failed
            self.link.close()
            if self.sidecar is not None:
                self.sidecar.terminate()
                self.sidecar.wait(10)
        return {"shim_steps": stats["steps"], "sidecar_steps": session.steps,
                "sidecar_tokens": session.scheduled_tokens, "losses": stats["losses"], "ring": stats["ring_counts"]}

    def _session_status(self):
        from omni_sidecar.client import SidecarClient

        with SidecarClient(self.link.conn.endpoint) as client:
            return client.status().sessions[0]


class InProcessUnderTest(ShimUnderTest):
    """The same link driving the same hook set in this process: no sidecar, no socket, no ring."""

    def _link(self, run_dir: Path, name: str, hooks: str):
        from bench.inproc import InProcessConnection
        from omni_sidecar.hook_api.loader import load_hooks
        from omni_sidecar.sessions.store import FinishedOutputs
        from worker_shim.step.link import SidecarLink

        def no_reconnect(**_: object) -> None:
            raise RuntimeError("nothing to reconnect to")

        return SidecarLink(no_reconnect, InProcessConnection(HELLO, load_hooks(hooks, HOOK_OPTIONS.get(hooks)),
                                                             FinishedOutputs(16)))

    def _session_status(self):
        return self.link.conn.session.status()


def percentiles(samples_s: list[float]) -> dict[str, float]:
    us = sorted(x * 1e6 for x in samples_s)
    return {"p50": statistics.median(us), "p90": us[round(0.9 * (len(us) - 1))],
            "p99": us[round(0.99 * (len(us) - 1))], "n": len(us)}


def measure(steps: int, num_reqs: int, forward_ms: float, hook_sets: dict[str, str] = HOOK_SETS,
            spin: bool = True, between_ms: float = 0.0) -> dict:
    run_dir = Path(tempfile.mkdtemp(prefix="omni-stepcost-"))
    atexit.register(shutil.rmtree, run_dir, True)  # its sockets: nothing left behind
    shims = {name: (InProcessUnderTest if name.endswith(INPROC) else ShimUnderTest)(run_dir, name, hooks, num_reqs)
             for name, hooks in hook_sets.items()}
    try:
        for shim in shims.values():
            shim.run(20, forward_ms / 1000, spin, between_ms / 1000)  # warm-up: the first step admits the requests
            shim.samples.clear()
            shim.cpu_samples.clear()
        done = 0
        while done < steps:
            block = min(BLOCK, steps - done)
            for shim in shims.values():
                shim.run(block, forward_ms / 1000, spin, between_ms / 1000)
            done += block
    finally:
        checks = {name: shim.close() for name, shim in shims.items()}
    return {name: {"wall": percentiles(shim.samples), "cpu": percentiles(shim.cpu_samples), **checks[name]}
            for name, shim in shims.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--forward-ms", type=float, default=2.5)
    p.add_argument("--forward-sleep", action="store_true", help="sleep through the forward instead of spinning")
    p.add_argument("--between-ms", type=float, default=0.0,
                   help="the engine's sampling and scheduling after a step's end, before the next (spun or slept "
                        "as the forward); with a plan every step, the sidecar's StepEnd and next plan overlap it")
    p.add_argument("--only", default="", help=f"comma-separated hook sets ({', '.join({**HOOK_SETS, **OMNI_SETS})})")
    args = p.parse_args()
    known = {**HOOK_SETS, **OMNI_SETS}
    names = [n for n in args.only.split(",") if n] or list(HOOK_SETS)
    unknown = [n for n in names if n not in known]
    if unknown:
        p.error(f"unknown hook set(s) {', '.join(unknown)}; choose from {', '.join(known)}")
    res = measure(args.steps, args.requests, args.forward_ms, {n: known[n] for n in names}, not args.forward_sleep,
                  args.between_ms)
    for name, r in res.items():
        cpu, wall = r["cpu"], r["wall"]
        print(f"shim host cost per step, {name:>18}, {args.requests} requests: CPU p50 {cpu['p50']:.1f} us "
              f"p99 {cpu['p99']:.1f} us | wall p50 {wall['p50']:.1f} us p99 {wall['p99']:.1f} us | {wall['n']} "
              f"steps (the sidecar saw {r['sidecar_steps']} of {r['shim_steps']}, {r['sidecar_tokens']} tokens)"
              + (f", kicks {r['ring']['kicks']}, shim sleeps {r['ring']['sleeps']}" if r["ring"] else ""),
              flush=True)


if __name__ == "__main__":
    main()
