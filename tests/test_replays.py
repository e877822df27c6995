"""Hooks see every position of a request once, also when vLLM recomputes it after a preemption."""

from __future__ import annotations

import torch

from omni_sidecar.sessions.replays import SeenPositions
from proto.packed import StepLayout


def test_a_resumed_request_s_recomputed_rows_are_dropped_and_its_new_row_kept():
    seen = SeenPositions()
    # Step 1: r1 prefills 4 prompt rows, r2 decodes at position 9 (it saw 9 before: fresh).
    seen.upto["r2"] = 9
    layout = StepLayout(["r1", "r2"], [0, 4, 5], [0, 9], [4, 3])
    hidden = torch.arange(5.0).view(5, 1)
    same, same_hidden = seen.fresh_rows(layout, hidden)
    assert same is layout and same_hidden is hidden
    # r1 decoded positions 4 and 5, then was preempted; it resumes and recomputes 0..6
    # (prefill_len 7) with r2's next decode row. Only position 6 of r1 is new.
    seen.fresh_rows(StepLayout(["r1"], [0, 1], [4], [4]), torch.zeros(1, 1))
    seen.fresh_rows(StepLayout(["r1"], [0, 1], [5], [4]), torch.zeros(1, 1))
    layout = StepLayout(["r1", "r2"], [0, 7, 8], [0, 10], [7, 3])
    hidden = torch.arange(8.0).view(8, 1)
    fresh, fresh_hidden = seen.fresh_rows(layout, hidden)
    assert fresh == StepLayout(["r1", "r2"], [0, 1, 2], [6, 10], [7, 3])
    assert fresh_hidden.flatten().tolist() == [6.0, 7.0]


def test_a_chunk_of_only_replayed_rows_leaves_the_request_out():
    seen = SeenPositions()
    seen.upto["r1"] = 10
    fresh, hidden = seen.fresh_rows(StepLayout(["r1", "r2"], [0, 4, 5], [0, 0], [11, 1]), torch.ones(5, 2))
    assert fresh == StepLayout(["r2"], [0, 1], [0], [1]) and hidden.shape == (1, 2)
    seen.forget(["r1"])
    assert "r1" not in seen.upto


def test_steady_steps_keep_the_record_and_a_replay_in_the_same_rows_is_still_caught():
    """Steady decode takes the column-wise path (the same request list each step); its record
    must be the one the row-by-row path would keep, and a count that falls back in the same rows
    (a resume that recomputes) still drops what was seen."""
    seen = SeenPositions()
    ids = ["r1", "r2"]
    for step in range(3):  # prefill, then two decode steps, the same list object as the session keeps it
        layout = StepLayout(ids, [0, 4, 8] if step == 0 else [0, 1, 2],
                             [0, 0] if step == 0 else [3 + step, 3 + step], [4, 4])
        assert seen.fresh_rows(layout, None) == (layout, None)
    assert seen.upto == {"r1": 6, "r2": 6}
    # r2 computed from position 4 again (2 rows: positions 4 and 5 were seen), r1 decodes on.
    layout = StepLayout(list(ids), [0, 1, 4], [6, 4], [4, 4])
    fresh, hidden = seen.fresh_rows(layout, torch.arange(4.0).view(4, 1))
    assert fresh == StepLayout(["r1", "r2"], [0, 1, 2], [6, 6], [4, 4])
    assert hidden.flatten().tolist() == [0.0, 3.0]
    assert seen.upto == {"r1": 7, "r2": 7}
    seen.forget(["r1"])
    assert seen.upto == {"r2": 7}
