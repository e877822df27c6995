"""Hooks see every position of a request once, also when vLLM recomputes it after a preemption."""

from __future__ import annotations

import torch

from omni_sidecar.replays import SeenPositions
from proto.messages import BatchLayout


def test_a_resumed_request_s_recomputed_rows_are_dropped_and_its_new_row_kept():
    seen = SeenPositions()
    # Step 1: r1 prefills 4 prompt rows, r2 decodes at position 9 (it saw 9 before: fresh).
    seen.upto["r2"] = 9
    layout = BatchLayout(["r1", "r2"], [0, 4, 5], [0, 9], [4, 3])
    hidden = torch.arange(5.0).view(5, 1)
    same, same_hidden = seen.fresh_rows(layout, hidden)
    assert same is layout and same_hidden is hidden
    # r1 decoded positions 4 and 5, then was preempted; it resumes and recomputes 0..6
    # (prefill_len 7) with r2's next decode row. Only position 6 of r1 is new.
    seen.fresh_rows(BatchLayout(["r1"], [0, 1], [4], [4]), torch.zeros(1, 1))
    seen.fresh_rows(BatchLayout(["r1"], [0, 1], [5], [4]), torch.zeros(1, 1))
    layout = BatchLayout(["r1", "r2"], [0, 7, 8], [0, 10], [7, 3])
    hidden = torch.arange(8.0).view(8, 1)
    fresh, fresh_hidden = seen.fresh_rows(layout, hidden)
    assert fresh == BatchLayout(["r1", "r2"], [0, 1, 2], [6, 10], [7, 3])
    assert fresh_hidden.flatten().tolist() == [6.0, 7.0]


def test_a_chunk_of_only_replayed_rows_leaves_the_request_out():
    seen = SeenPositions()
    seen.upto["r1"] = 10
    fresh, hidden = seen.fresh_rows(BatchLayout(["r1", "r2"], [0, 4, 5], [0, 0], [11, 1]), torch.ones(5, 2))
    assert fresh == BatchLayout(["r2"], [0, 1], [0], [1]) and hidden.shape == (1, 2)
    seen.forget(["r1"])
    assert "r1" not in seen.upto
