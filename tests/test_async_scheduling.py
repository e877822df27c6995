"""With async scheduling (vLLM's default on GPU) the engine calls the next step's execute_model before
it reads the last step's output; the shim's step path is the same, and no step waits for the
sidecar's work on the step before it (docs/ARCHITECTURE.md, "Async scheduling").

This drives the shim's real link, connection and rings against a real sidecar process with vLLM's
batch faked, as the engine's calls come with it on: each step's execute_model, then its
sample_tokens returning V2's AsyncOutput (not yet copied to the host), then the next step's.
tests/test_e2e_async_scheduling.py runs a real engine with it on; the step times with it on and off
are the GPU's to show (deploy/gpu).
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import msgspec
import pytest
import torch

from bench.step_cost import decode_state
from proto.messages import Hello
from proto.version import PROTOCOL_MAJOR, PROTOCOL_MINOR
from tests.support.procs import SidecarProcess

HIDDEN = 8
SLOTS = 2  # the shim's default hidden_slots


class PendingOutput:
    """V2's AsyncOutput as sample_tokens returns it under async scheduling: its device-to-host copy
    still running. Reading its ids before the engine does would make the step wait for the device."""

    def __init__(self, req_ids: list[str], token: int) -> None:
        self.model_runner_output = SimpleNamespace(req_ids=req_ids)
        self.sampled_token_ids = [[token] for _ in req_ids]
        self.num_sampled_tokens_np = [1] * len(req_ids)
        self.copy_event = self
        self.waited = 0

    def synchronize(self) -> None:
        self.waited += 1


@pytest.fixture
def link(tmp_path):
    from worker_shim.config import RingConfig
    from worker_shim.step.link import SidecarLink
    from worker_shim.wire.connection import SidecarConnection

    sidecar = SidecarProcess(f"ipc://{tmp_path}/sc.sock", "tests.support.slow_reader_hooks:SlowReaderHooks",
                             tmp_path / "sidecar.log")
    hello = Hello(PROTOCOL_MAJOR, PROTOCOL_MINOR, "test", "none", "cpu", 0, 1, "m", HIDDEN, "float32", 64, [],
                  pid=os.getpid())

    def connect(endpoint: str = sidecar.endpoint, resume_token: str = "") -> SidecarConnection:
        return SidecarConnection(endpoint, 10.0, msgspec.structs.replace(hello, resume_token=resume_token),
                                 1 << 16, SLOTS, arena_prefix="omni-test-async", ring=RingConfig())

    conn = connect()
    conn.connect(10.0)
    link = SidecarLink(connect, conn, length_finishes=False)
    try:
        yield link
    finally:
        link.close()
        sidecar.stop()


def test_no_step_waits_for_the_sidecars_work_on_the_step_before(link):
    channel = link.conn.channel
    waited_for: list[tuple[int, int]] = []  # (the step waiting, the step whose result it waited for)
    take_results = channel.take_results

    def recording(until_step=None):
        if until_step is not None and channel.acked_step < until_step:
            waited_for.append((link.step, until_step))
        return take_results(until_step)

    channel.take_results = recording
    req_ids = [f"cmpl-{i}-abcdef12" for i in range(4)]
    link.note_new([SimpleNamespace(req_id=r, prompt_token_ids=[1, 2, 3], prompt_len=3,
                                   sampling_params=SimpleNamespace(extra_args=None)) for r in req_ids])
    outputs = []
    for step in range(12):  # execute_model, then sample_tokens; the engine reads outputs later
        link.note_finished(set(), None)
        link.begin_step()
        link.pre_forward(decode_state(req_ids, step).input_batch, None)
        link.end_step(decode_state(req_ids, step, torch.full((len(req_ids), HIDDEN), float(step))))
        outputs.append(PendingOutput(req_ids, step))
        link.note_sampled(outputs[-1])
    # The sidecar is slower than the steps: they did wait, each only for the step whose slot it
    # reuses, never for the one just before it.
    assert waited_for, "the steps never outran the sidecar: the test proves nothing"
    assert all(step - answered >= SLOTS for step, answered in waited_for), waited_for
    assert sum(o.waited for o in outputs) == 0  # no sampled ids read while the engine runs
    stats = link.stats()
    assert stats["steps"] == 12 and stats["blocking_exchanges"] == 0 and stats["losses"] == 0
