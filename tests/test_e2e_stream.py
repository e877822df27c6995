"""Streaming payloads end to end: real vLLM V2 (CPU) with the shim, a real sidecar process, and a
client appending to a running request while the engine runs."""

from __future__ import annotations

import json
import threading
import time

import pytest
import torch

from tests.support.procs import SidecarProcess, run_engine

pytestmark = pytest.mark.e2e

MAX_TOKENS = [40, 3, 40]  # request "1" finishes early: appending to it then is refused


def _part(start: int, rows: int, tag: str) -> dict:
    """An `embed.decode` span [start, start + rows) (row i holds position i) and a meta marker."""
    decode = torch.arange(start, start + rows, dtype=torch.float32).view(rows, 1).repeat(1, 4)
    return {"embed": {"decode": decode, "decode_token_start": start, "decode_token_end": start + rows},
            "meta": {f"appended_{tag}": 1}}


def test_appended_payloads_reach_the_next_step_in_order(tiny_model, e2e_dir, tmp_path):
    from omni_sidecar.client import AppendRefused, SidecarClient

    endpoint = f"ipc://{tmp_path}/sc.sock"
    probe_log = tmp_path / "probe.jsonl"
    sidecar = SidecarProcess(endpoint, "tests.support.stream_hooks:StreamProbeHooks", tmp_path / "sidecar.log",
                             env={"OMNI_STREAM_LOG": str(probe_log)})
    got: dict = {}

    def seen_after(step: int, timeout_s: float = 60.0) -> None:
        """Wait until the hooks of a step after `step` ran (the probe's log has its rows)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if any(json.loads(line)["step"] > step for line in probe_log.read_text().splitlines()):
                return
            time.sleep(0.01)
        raise TimeoutError(f"no step after {step} within {timeout_s}s")

    def stream_in() -> None:  # the previous stage, appending while vLLM runs the requests
        try:
            with SidecarClient(endpoint, timeout_s=30) as client:
                list(client.stream("1", poll_s=0.01, timeout_s=300))  # until "1" finished
                got["a"] = client.append("0", _part(0, 2, "a"))
                seen_after(got["a"])  # spread over steps: each state below is seen by some step
                got["b"] = client.append("0", _part(2, 3, "b"))
                seen_after(got["b"])
                for name, req_id, part in (("gap", "0", _part(9, 1, "gap")), ("unknown", "nope", _part(0, 1, "x")),
                                           ("finished", "1", _part(0, 1, "x"))):
                    try:
                        client.append(req_id, part)
                        got[name] = ("accepted", "")
                    except AppendRefused as exc:
                        got[name] = (exc.code, str(exc))
                got["c"] = client.append("0", _part(4, 2, "c"))  # overlaps [0, 5): trimmed to [5, 6)
        except BaseException as exc:  # the test reads it
            got["error"] = repr(exc)

    streamer = threading.Thread(target=stream_in, daemon=True)
    streamer.start()
    prompts = [{"token_ids": [5 + i] * 6, "max_tokens": n,
                "payload": {"additional_information": {"meta": {"tag": f"r{i}"}}}} for i, n in enumerate(MAX_TOKENS)]
    try:
        res = run_engine(
            {"model": tiny_model, "prompts": prompts, "shim": True, "endpoint": endpoint,
             "llm_kwargs": {"enable_prefix_caching": False}},
            e2e_dir, "omni-stream",
        )
        streamer.join(60)
    finally:
        sidecar.stop()
    assert res["ok"], res.get("traceback")
    assert not streamer.is_alive(), f"the appending client is still waiting: {got}"
    assert "error" not in got, got["error"]
    assert res["shim_stats"][0]["request_errors"] == {}  # the refused appends failed no request
    assert [len(t) for t in res["tokens"]] == MAX_TOKENS
    assert got["gap"][0] == "append_refused" and "leaves a gap after [0, 5)" in got["gap"][1]
    assert got["unknown"][0] == "unknown_request" and "'nope' is not running" in got["unknown"][1]
    assert got["finished"][0] == "request_finished" and "'1' has finished" in got["finished"][1]

    rows = [json.loads(line) for line in probe_log.read_text().splitlines()]
    by_tag: dict[str, list[dict]] = {}  # the tag each prompt's payload put in its state
    for row in rows:
        by_tag.setdefault(row["tag"], []).append(row)
    assert sorted(by_tag) == ["r0", "r1", "r2"]
    after = {"appended_a": got["a"], "appended_b": got["b"], "appended_c": got["c"]}
    assert got["a"] < got["b"] < got["c"]
    for row in by_tag["r0"]:  # per step: exactly the appends answered before this step began
        step = row["step"]
        assert row["appended"] == sorted(k for k, last in after.items() if step > last), row
        if step > got["c"]:
            assert row["span"] == [0, 6] and row["decode"] == [0, 1, 2, 3, 4, 5], row
        elif step > got["b"]:
            assert row["span"] == [0, 5] and row["decode"] == [0, 1, 2, 3, 4], row
        elif step > got["a"]:
            assert row["span"] == [0, 2] and row["decode"] == [0, 1], row
        else:
            assert row["span"] is None, row
    steps = [row["step"] for row in by_tag["r0"]]
    bounds = [-1, got["a"], got["b"], got["c"], max(steps)]
    for low, high in zip(bounds, bounds[1:]):  # not vacuous: some step saw each state (before a, a, a+b, a+b+c)
        assert any(low < s <= high for s in steps), (steps, got)
    for tag, rs in by_tag.items():
        positions = [r["position"] for r in rs]
        assert positions == sorted(set(positions))  # each position once, in order
        if tag != "r0":
            assert all(r["appended"] == [] and r["span"] is None for r in rs), tag  # the others untouched
