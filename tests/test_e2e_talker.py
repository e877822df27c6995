"""A Qwen3-TTS-shaped talker through the model-hook bridge: real vLLM V2 (CPU), the shim, a real sidecar.

The tiny talker (tests/tiny_models/talker.py) carries vllm-omni's hook API; the shim calls its hooks in
vllm-omni's order, the sidecar (`omni-talker` + a state digest) decodes the payloads, keeps
the state and assembles `codes.audio`. Requests of different prompt and text lengths run
together with chunked prefill (16 tokens per step); their codes must equal a direct
step-by-step forward of the same weights (tests/support/talker_reference.py). The same
requests run again while the sidecar is hot-upgraded mid-stream: codes and the sidecar's
state go on unchanged, and no state is sent to the shim twice. Then, on the successor, a client
appends to a running request: the model's own hooks see it from the step after the reply's
`after_step` on, never before.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from tests.support.procs import ROOT, SidecarProcess, run_engine

pytestmark = pytest.mark.e2e
HOOKS = "tests.support.talker_hooks:StateDigestTalkerHooks"
# prompt rows (BOS + PAD, filled from the thinker rows), thinker rows, decode length
REQUESTS = [
    {"prompt_len": 5, "text_len": 9, "seed": 1, "max_tokens": 30},
    {"prompt_len": 23, "text_len": 30, "seed": 2, "max_tokens": 18},
    {"prompt_len": 12, "text_len": 8, "seed": 3, "max_tokens": 26},  # thinker rows end inside the prompt
    {"prompt_len": 37, "text_len": 40, "seed": 4, "max_tokens": 22},
    {"prompt_len": 8, "text_len": 20, "seed": 5, "max_tokens": 34},
]
MAX_BATCHED_TOKENS = 16  # prompts of 23 and 37 rows prefill in chunks next to others' decodes


@pytest.fixture(scope="module")
def talker_model(tmp_path_factory):
    from tests.tiny_models.talker import build_tiny_talker

    return str(build_tiny_talker(tmp_path_factory.mktemp("tiny-talker")))


@pytest.fixture(scope="module")
def talker_run(talker_model, tmp_path_factory):
    work = tmp_path_factory.mktemp("talker")
    endpoint = f"ipc://{work}/sc.sock"
    sidecar = SidecarProcess(endpoint, HOOKS, work / "sidecar.log")
    try:
        res = run_engine(
            {"model": talker_model, "endpoint": endpoint, "requests": REQUESTS, "hooks": HOOKS,
             "upgrade_after_steps": 6, "append_after_steps": 8, "sidecar_log": str(work / "sidecar.log"),
             "llm_kwargs": {"max_model_len": 256, "max_num_batched_tokens": MAX_BATCHED_TOKENS,
                            "max_num_seqs": 8}},
            work, "talker", script=ROOT / "tests" / "support" / "talker_job.py",
        )
    finally:
        _stop_successor(endpoint, sidecar.proc.pid)
        sidecar.stop()
    assert res["ok"], res.get("traceback")
    return res


def _stop_successor(endpoint: str, first_pid: int) -> None:
    """The sidecar the hot upgrade started (serving the endpoint now) is ours to stop."""
    from omni_sidecar.client import SidecarClient, SidecarUnavailable

    try:
        with SidecarClient(endpoint) as client:
            pid = client.status().pid
    except (SidecarUnavailable, OSError):
        return
    if pid and pid != first_pid:
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and os.path.exists(f"/proc/{pid}"):
            time.sleep(0.1)


@pytest.fixture(scope="module")
def reference(talker_model):
    from tests.support.talker_payload import talker_request
    from tests.support.talker_reference import reference_codes

    requests = [{**talker_request(r["prompt_len"], r["text_len"], r["seed"], r["max_tokens"]), "ignore_eos": True}
                for r in REQUESTS]
    return reference_codes(talker_model, requests)


def _check_run(run, reference):
    for i, (spec, ref) in enumerate(zip(REQUESTS, reference)):
        assert run["tokens"][i] == ref["tokens"], f"request {i}: sampled code 0 differs"
        codes = torch.tensor(run["codes"][i])
        assert codes.shape == (spec["max_tokens"] - 1, 4)  # one row per decode step
        assert torch.equal(codes, ref["codes"]), f"request {i}: codes differ from the reference"
        digest = run["digests"][i]
        # The sidecar's state followed the model's updates: the text row the next decode step
        # would read, and the last codes it keeps (merged like vllm-omni keeps them).
        assert digest["state.text_pos"] == spec["max_tokens"] - 1
        assert digest["state.codes"] == ref["codes"][-1].tolist()


def test_talker_codes_equal_the_direct_forward(talker_run, reference):
    first = talker_run["runs"][0]
    _check_run(first, reference)
    (shim,) = talker_run["shim_stats"]
    assert shim["request_errors"] == {}
    # Blocking exchanges only on steps that bring new requests, never on pure decode steps.
    assert 1 <= shim["blocking_exchanges"] <= 2 * len(REQUESTS)
    assert shim["steps"] >= 2 * max(r["max_tokens"] for r in REQUESTS)
    assert shim["blocking_exchanges"] * 4 < shim["steps"]


def test_talker_codes_and_state_survive_a_hot_upgrade_mid_stream(talker_run, reference):
    second = talker_run["runs"][1]
    upgrade = talker_run["upgrade"]
    assert upgrade["rc"] == 0, upgrade["err"]
    assert upgrade["live_at_takeover"] == len(REQUESTS)  # every request switched mid-stream
    (shim,) = talker_run["shim_stats"]
    assert shim["switches"] == 1 and shim["losses"] == 0
    _check_run(second, reference)
    # Each request's state went to the shim once: the successor was never asked again.
    assert shim["states_asked"] == 2 * len(REQUESTS)


def test_an_append_reaches_the_models_own_hooks_from_the_step_after_its_reply(talker_run, reference):
    appended = talker_run["append"]
    assert "error" not in appended, appended.get("error")
    after = appended["after_step"]
    assert after >= appended["sent_at_step"]
    before = [probe for step, probe in appended["seen"] if step <= after]
    later = [(step, probe) for step, probe in appended["seen"] if step > after]
    assert before and set(before) == {None}  # no step up to after_step saw it
    assert later and {probe for _, probe in later} == {7}  # every later step did
    assert later[0][0] == after + 1  # from the very next step on (one decode row per step)
    third = talker_run["runs"][2]
    assert third["digests"][0]["state.probe"] == 7  # the sidecar's state holds it too
    assert torch.equal(torch.tensor(third["codes"][0]), reference[0]["codes"])  # a probe the model ignores
