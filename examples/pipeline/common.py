"""What every stage process shares: its engine, the start barrier, step timing, its result file."""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path
from typing import Any


def set_environment(cuda: bool) -> None:
    """Before vLLM is imported: V2, offline, and (CPU) what V2 needs on a CPU host."""
    defaults = {"HF_HUB_OFFLINE": "1", "VLLM_USE_V2_MODEL_RUNNER": "1", "VLLM_NO_USAGE_STATS": "1",
                "TOKENIZERS_PARALLELISM": "false"}
    if not cuda:
        defaults.update(TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    for key, value in defaults.items():
        os.environ.setdefault(key, value)
    # The driver steps its own engine (gating on its inputs): engine core in this process.
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"


# The step a stage waits before looking at its inputs again, when they are not there yet.
INPUT_POLL_S = 0.002
# A stage that has neither stepped nor seen new input for this long stops, saying what it waits for.
STALL_S = 60.0


class Progress:
    """A stage's request-level events, one line each (never per step), and its stall watchdog."""

    def __init__(self, stage: str, go: float) -> None:
        self.stage, self.go = stage, go
        self.last = time.monotonic()

    def note(self, event: str | None = None) -> None:
        self.last = time.monotonic()
        if event:
            print(f"[{self.stage} +{time.time() - self.go:7.3f}s] {event}", flush=True)

    def check(self, waiting_for: Any) -> None:
        """`waiting_for()`: one line on what the stage waits for, for the error if it stalled."""
        if time.monotonic() - self.last > STALL_S:
            raise TimeoutError(f"the {self.stage} stage made no progress for {STALL_S:.0f}s; {waiting_for()}")


def make_engine(config: dict[str, Any], stage: str, **kwargs: Any) -> Any:
    """An upstream LLM (V2 runner, the shim as its worker) talking to the stage's sidecar."""
    from vllm import LLM

    gpu = bool(config.get("cuda"))
    engine = dict(dtype="bfloat16" if gpu else "float32", max_model_len=256, seed=0, enable_prefix_caching=False,
                  # The driver gates each step on what it has fed in: a step must not run ahead.
                  async_scheduling=False,
                  enforce_eager=not gpu, worker_cls="worker_shim.Worker",
                  additional_config={"omni_sidecar": {"endpoint": config["endpoints"][stage]}})
    if gpu:  # three engines on one GPU, started at once
        engine.update(gpu_memory_utilization=0.2, kv_cache_memory_bytes=256 << 20)
    else:
        engine["kv_cache_memory_bytes"] = 32 << 20
    engine.update(kwargs)
    return LLM(model=config["models"][stage], **engine)


def wait_for_go(config: dict[str, Any], stage: str) -> float:
    """Say this stage's engine is up and wait for the demo to start all stages at once (the wall
    time it started them: time-to-first-audio counts from there, not from engine start-up)."""
    run_dir = Path(config["run_dir"])
    (run_dir / f"{stage}.ready").write_text("1")
    go = run_dir / "go"
    while not go.exists():
        time.sleep(0.01)
    return float(go.read_text())


class StepTimes:
    """Wall time of each engine step this stage ran (ms)."""

    def __init__(self) -> None:
        self.ms: list[float] = []

    def step(self, engine: Any) -> list[Any]:
        t0 = time.perf_counter()
        outs = engine.step()
        self.ms.append((time.perf_counter() - t0) * 1e3)
        return outs

    def summary(self) -> dict[str, float]:
        if not self.ms:
            return {"steps": 0}
        ordered = sorted(self.ms)
        return {"steps": len(ordered), "p50_ms": statistics.median(ordered),
                "p90_ms": ordered[int(0.9 * (len(ordered) - 1))], "total_ms": sum(ordered)}


def shim_figures(llm: Any) -> dict[str, Any]:
    """The shim's own per-step figures (StepEnd cost, blocking round trips)."""
    (stats,) = llm.collective_rpc("omni_sidecar_stats")
    keys = ("steps", "blocking_exchanges", "exchange_us_p50", "post_us_p50")
    return {k: stats[k] for k in keys if k in stats}


def write_result(config: dict[str, Any], stage: str, result: dict[str, Any]) -> None:
    path = Path(config["run_dir"]) / f"{stage}.{config['mode']}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result))
    tmp.rename(path)


def finish(llm: Any) -> None:
    """Stop the engine and leave without the interpreter's slow teardown."""
    import sys

    if llm is not None:
        llm.llm_engine.engine_core.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


class Appends:
    """A stage's appends into its own running requests, in before the step that needs them.

    Sent without waiting (`AppendStream`): an append to a model reading the shim's mirror is
    answered only after a step applied it. Before stepping, `wait_in` waits until each append
    sent since the last step is either answered (applied in the sidecar) or waiting in the
    worker for the step start (`omni_sidecar_mirror_waiting`)."""

    def __init__(self, endpoint: str, llm: Any) -> None:
        from omni_sidecar.client import AppendStream

        self.stream = AppendStream(endpoint)
        self.llm = llm
        self.sent = 0  # since the last step
        self.answered = 0  # of those

    def send(self, req_id: str, payload: dict[str, Any]) -> None:
        self.stream.send(req_id, payload)
        self.sent += 1

    def wait_in(self, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while self.sent:
            self.answered += len(self.stream.answers())
            (waiting,) = self.llm.collective_rpc("omni_sidecar_mirror_waiting")
            if self.answered + waiting >= self.sent:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.sent - self.answered - waiting} append(s) did not reach the engine "
                                   f"within {timeout_s:.0f}s")
            time.sleep(INPUT_POLL_S)

    def stepped(self) -> None:
        self.stream.answers()
        self.sent = self.answered = 0

    def close(self) -> None:
        """Every append answered (a refusal raises AppendRefused)."""
        while self.stream.in_flight:
            if not self.stream.answers(wait_s=10.0):
                raise TimeoutError(f"{len(self.stream.in_flight)} append(s) never answered")
        self.stream.close()


def gated_step(engine: Any, feeds: dict[str, Any], ready: Any, times: StepTimes, appends: Appends,
               progress: Progress, finished_line: Any) -> list[str] | None:
    """One engine step if every running request has what its next step reads (`ready(feed)`),
    its appends in first; else a short wait (the stall watchdog watching). The ids that finished
    in the step (None: it waited)."""
    from examples.pipeline.feeds import describe, note_outputs

    live = [f for f in feeds.values() if f.live]
    if not live or not all(ready(f) for f in live):
        progress.check(lambda: describe(list(feeds.values())))
        time.sleep(INPUT_POLL_S)
        return None
    appends.wait_in()
    done = note_outputs(feeds, times.step(engine))
    for req_id in done:
        progress.note(finished_line(req_id))
    progress.note()
    appends.stepped()
    return done
