"""The omni set's host work per decode step, both sides of the boundary, phase by phase.

With the omni set sending extra kwargs every step (each request's state as vllm-omni's
`runtime_additional_information`), a decode step costs the sidecar its StepEnd (postprocess: the
state merge, the step's rows kept) and the next step's plan (built ahead, while the shim samples
and schedules), and costs the shim the plan's read (decode the StepPlan, copy its tensors out of the
sidecar's arena). What the shim waits on is the StepEnd plus the plan; between steps (`settle`,
after the plan is out) the logged step is noted in each request's log (its chunks are cut when
read). Measured on the sidecar's real `Session` and the
shim's real decode and copy-out, in this process (no socket or ring: bench.step_cost and bench.gpu
measure those), steady decode of N requests with hidden size H, hook sets side by side in
alternating blocks:
- `omni`: the plan's trees as msgpack bytes, each tensor an extension value naming a stack of the
  plan's same-shaped tensors (proto/plan_trees.py), read as the shim's connection reads it: the
  shared decoder places the tensors, the kwargs land in its buffers, their views kept
  (worker_shim/step/plan_read.py);
- `omni-per-request`: the same with `postprocess` overridden (the default's body, called per request
  and merged one request at a time): what a model's subclass pays.
Timings only: nothing here passes or fails.

    python -m bench.omni_step [--requests 64,256] [--hidden 2048] [--steps 600] [--write]

`make bench` runs it as part (f); `--write` rewrites just that section of `make bench`'s report
(.bench/cpu.md).
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import time
from pathlib import Path

import msgspec
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from omni_sidecar.serve.metrics import SidecarMetrics  # noqa: E402
from omni_sidecar.hook_sets.omni.state_hooks import OmniStateHooks  # noqa: E402
from omni_sidecar.sessions.session import Session  # noqa: E402
from omni_sidecar.sessions.store import FinishedOutputs  # noqa: E402
from proto.arena import ShmArena  # noqa: E402
from proto.messages import Hello, NewRequest, StepBegin, StepEnd, StepPlan  # noqa: E402
from proto.packed import packed_layout  # noqa: E402
from proto.tensors import TensorRef  # noqa: E402
from proto.version import PROTOCOL_MAJOR, PROTOCOL_MINOR  # noqa: E402
from worker_shim.step.plan_read import PlanLanding  # noqa: E402
from worker_shim.step.plan_read import read_plan  # noqa: E402

PHASES = ("end", "plan", "settle", "shim_read")
MODEL = torch.nn.Linear(1, 1)  # what the shim reads the plan for: its device (the host)
BLOCK = 100  # steps per block; hook sets alternate block by block
PROMPT = 8


class PerRequestPostprocess(OmniStateHooks):
    """The default postprocess, as a model's subclass has it: called per request."""

    def postprocess(self, req_id, hidden_rows, state):
        return super().postprocess(req_id, hidden_rows, state)


CONFIGS = {"omni": OmniStateHooks, "omni-per-request": PerRequestPostprocess}


class Run:
    """One hook set's session, its shim-side arena and a steady decode of `n` requests."""

    def __init__(self, hooks_cls: type, n: int, hidden: int, layers: list[int]) -> None:
        self.n = n
        rows_bytes = PROMPT * n * hidden * 4
        # The step's hidden rows, then each captured layer's, as the shim writes a slot.
        self.shim_arena = ShmArena.create(rows_bytes * (1 + len(layers)) + (1 << 20), prefix="omni-bench-step")
        hello = Hello(PROTOCOL_MAJOR, PROTOCOL_MINOR, "bench", "none", "cpu", 0, 1, "m", hidden, "float32", PROMPT * n,
                      [self.shim_arena.info()])
        hooks = hooks_cls(extra_kwargs="1", hidden_layers=",".join(map(str, layers)))
        self.session = Session(1, hello, hooks, FinishedOutputs(10), SidecarMetrics())
        self.session.open_arenas()
        self.decoder = msgspec.msgpack.Decoder(StepPlan)
        # The plan's kwargs land in the shim's buffers, their views kept, as its connection reads them.
        self.landing = PlanLanding()
        gen = torch.Generator().manual_seed(0)
        for k in range(1 + len(layers)):
            self.shim_arena.view(TensorRef(0, k * rows_bytes, rows_bytes, [rows_bytes], "uint8"))[:] = (
                torch.randn(PROMPT * n, hidden, generator=gen).numpy().tobytes())

        def refs(rows: int) -> tuple[TensorRef, dict[int, TensorRef]]:
            at = [TensorRef(0, k * rows_bytes, rows * hidden * 4, [rows, hidden], "float32") for k in range(1 + len(layers))]
            return at[0], dict(zip(layers, at[1:]))

        self.rows, self.layer_rows = refs(n)
        self.prefill_rows = refs(PROMPT * n)
        self.step = 0
        self.batches = 0
        self.req_ids: list[str] = []
        self.plan_bytes = 0

    def start_batch(self) -> None:
        """The live requests finish (their outputs go to the finished store) and n new ones prefill:
        each block decodes requests of its own, so outputs kept per token stay bounded, as requests
        that finish keep them."""
        s, n = self.session, self.n
        self.step += 1
        if self.req_ids:
            s.step_end(StepEnd(self.step, None, finished=list(self.req_ids)))
            self.step += 1
        self.batches += 1
        ids = self.req_ids = [f"b{self.batches}-{i}" for i in range(n)]
        self.first_decode = self.step + 1
        s.step_begin(StepBegin(self.step, packed_layout(ids, list(range(0, PROMPT * n + 1, PROMPT)), [0] * n, [PROMPT] * n),
                               new_requests=[NewRequest(r, PROMPT, list(range(PROMPT))) for r in ids]))
        rows, layers = self.prefill_rows
        s.step_end(StepEnd(self.step, None, hidden=rows, hidden_layers=layers, num_tokens=PROMPT * n))
        s.plan_ahead()
        s.between_steps()

    def decode_step(self, times: dict[str, list[float]]) -> None:
        self.step += 1
        k, n, s = self.step, self.n, self.session
        position = PROMPT + k - self.first_decode
        plan = s.step_begin(StepBegin(k, packed_layout(None, list(range(n + 1)), [position] * n, [PROMPT] * n)))
        wire = msgspec.msgpack.encode(plan)  # the sidecar's encode: not timed (the ring's)
        t0 = time.perf_counter()
        got = self.decoder.decode(wire)
        read_plan(s.arenas.out.arena, got, None, MODEL, None, self.landing)
        t1 = time.perf_counter()
        s.step_end(StepEnd(k, None, hidden=self.rows, hidden_layers=self.layer_rows, num_tokens=n))
        t2 = time.perf_counter()
        if s.ahead is not None:
            s.ahead.build()
        t3 = time.perf_counter()
        s.hooks.between_steps()
        t4 = time.perf_counter()
        for name, dt in zip(PHASES, (t2 - t1, t3 - t2, t4 - t3, t1 - t0)):
            times[name].append(dt * 1e6)
        self.plan_bytes = len(wire)

    def close(self) -> None:
        self.landing.close()
        self.session.close()
        self.shim_arena.close()


def _stats(values: list[float]) -> dict[str, float]:
    q = statistics.quantiles(values, n=100)
    return {"p50": statistics.median(values), "p10": q[9], "p90": q[89]}


def measure(requests: list[int], hidden: int, steps: int, layers: list[int]) -> dict[str, dict]:
    torch.set_num_threads(1)  # the sidecar's host ops at these sizes: threads cost more than they give
    out: dict[str, dict] = {}
    for n in requests:
        runs = {name: Run(cls, n, hidden, layers) for name, cls in CONFIGS.items()}
        times = {name: {p: [] for p in PHASES} for name in runs}
        plans_used = {}
        try:
            for run in runs.values():  # warm-up, not recorded
                run.start_batch()
                for _ in range(20):
                    run.decode_step({p: [] for p in PHASES})
            for _ in range(max(1, steps // BLOCK)):
                for name, run in runs.items():
                    run.start_batch()
                    for _ in range(BLOCK):
                        run.decode_step(times[name])
            for name, run in runs.items():
                status = run.session.status()
                plans_used[name] = (status.plans_ahead_used, status.steps)
        finally:
            for run in runs.values():
                run.close()
        for name, phases in times.items():
            stats = {p: _stats(v) for p, v in phases.items()}
            critical = [e + p for e, p in zip(phases["end"], phases["plan"])]
            out[f"{name} x{n}"] = {"requests": n, "hidden": hidden, "layers": layers, "config": name, "phases": stats,
                                   "waited_on": _stats(critical), "plan_bytes": runs[name].plan_bytes,
                                   "plans_ahead_used": plans_used[name][0], "steps": plans_used[name][1]}
    return out


def markdown(res: dict[str, dict]) -> list[str]:
    lines = [
        "## (f) The omni set's host work per decode step", "",
        "`python -m bench.omni_step`: the omni set sending each request's state as extra kwargs every step "
        "(hidden size 2048, fp32 host memory, two decoder layers captured with the hidden states, as in "
        "bench.gpu's omni runs), steady decode, the sidecar's real `Session` and the shim's real "
        "plan decode and copy-out in one process, hook sets in alternating blocks of 100 steps. `end`: the "
        "sidecar's StepEnd (postprocess, state merge); `plan`: the next plan, built ahead; `settle`: the "
        "step's outputs noted per request after the plan is out (cut when a client reads them); `shim read`: decode the StepPlan and copy its tensors "
        "out. The shim waits on `end + plan` when they outlast its own sampling and scheduling. `omni`: the "
        "plan's same-shaped tensors stacked, its trees as bytes whose tensors are extension values (the "
        "shim's decoder places them, no walk; the kwargs land in the shim's buffers, their views kept); "
        "`omni-per-request`: `postprocess` overridden (a model's subclass). "
        "p50 (p10-p90) in us. " + _measured_on(), "",
        "| requests | plan for | end | plan | end + plan | settle | shim read | plan bytes |",
        "|---:|---|---:|---:|---:|---:|---:|---:|",
    ]

    def cell(s: dict) -> str:
        return f"{s['p50']:.0f} ({s['p10']:.0f}-{s['p90']:.0f})"

    for r in res.values():
        ph = r["phases"]
        lines.append(f"| {r['requests']} | {r['config']} | {cell(ph['end'])} | {cell(ph['plan'])} | "
                     f"**{cell(r['waited_on'])}** | {cell(ph['settle'])} | **{cell(ph['shim_read'])}** | "
                     f"{r['plan_bytes']} |")
    by = {(r["requests"], r["config"]): r for r in res.values()}
    ratios = []
    for n in sorted({r["requests"] for r in res.values()}):
        old, new = by.get((n, "omni")), by.get((n, "omni-per-request"))
        if old and new:
            ratios.append(f"{n} requests: end omni-per-request / omni "
                          f"**{new['phases']['end']['p50'] / old['phases']['end']['p50']:.2f}**")
    lines += ["", "Ratios of p50s measured side by side: " + "; ".join(ratios) + ". The plan and the shim's "
              "read run the same code for both (only `postprocess` differs): a difference there is the machine. "
              "On a CPU host its spread at 256 requests is the allocator (three fresh 2 MiB output copies a "
              "step); on a GPU those copies are the device's.", ""]
    return lines


def _measured_on() -> str:
    from bench.__main__ import versions

    v = versions()
    return (f"Measured {time.strftime('%Y-%m-%d')} on a {v['cores']}-core {v['cpu']} machine, Python {v['python']}, "
            f"torch {v['torch']}, msgspec {v['msgspec']}.")


def write_section(path: Path, lines: list[str]) -> None:
    """Section (f) of the report replaced (or put before "## Reproduce"), the rest as it was."""
    if not path.exists():
        raise SystemExit(f"{path} does not exist: run `make bench` first")
    text = path.read_text()
    section = "\n".join(lines) + "\n"
    old = re.search(r"^## \(f\).*?(?=^## )", text, flags=re.S | re.M)
    if old is not None:
        text = text[: old.start()] + section + text[old.end():]
    else:
        at = re.search(r"^## Reproduce", text, flags=re.M)
        if at is None:
            raise SystemExit(f"{path} has no '## Reproduce' section: run `make bench`")
        text = text[: at.start()] + section + text[at.start():]
    path.write_text(text)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", default="64,256", help="batch sizes, comma-separated")
    p.add_argument("--hidden", type=int, default=2048, help="hidden size (2048: a ~1B model)")
    p.add_argument("--steps", type=int, default=600, help="measured steps per hook set and batch size")
    p.add_argument("--layers", default="0,8", help="captured decoder layers (bench.gpu's omni runs capture two)")
    p.add_argument("--write", action="store_true", help="rewrite section (f) of --markdown with the figures")
    p.add_argument("--markdown", default=str(ROOT / ".bench" / "cpu.md"), help="`make bench`'s report")
    args = p.parse_args()
    res = measure([int(n) for n in args.requests.split(",")], args.hidden, args.steps,
                  [int(x) for x in args.layers.split(",") if x.strip()])
    lines = markdown(res)
    print("\n".join(lines))
    if args.write:
        write_section(Path(args.markdown), lines)
        print(f"rewrote section (f) of {args.markdown}")


if __name__ == "__main__":
    main()
