"""The shim's own finish detection (worker_shim/finishes.py), on fake vLLM batches."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from worker_shim.finishes import FinishWatch


def _req(req_id, max_tokens, eos=None, stop=()):
    return SimpleNamespace(req_id=req_id, sampling_params=SimpleNamespace(
        max_tokens=max_tokens, eos_token_id=eos, stop_token_ids=list(stop)))


def _batch(ids, computed, scheduled, prefill):
    qsl = np.concatenate([[0], np.cumsum(scheduled)]).astype(np.int32)
    return SimpleNamespace(req_ids=ids, query_start_loc_np=qsl, num_computed_tokens_np=np.array(computed),
                           prefill_len_np=np.array(prefill))


def test_a_request_finishes_by_length_in_the_step_that_samples_its_last_token():
    watch = FinishWatch()
    watch.note_new(_req("a", max_tokens=3), prompt_len=4)  # last output sampled after 4 + 3 - 1 = 6
    watch.note_new(_req("b", max_tokens=1), prompt_len=10)
    # a: a prefill chunk (samples nothing); b: its whole prompt, sampling its only token.
    assert watch.by_length(_batch(["a", "b"], [0, 0], [2, 10], [4, 10])) == ["b"]
    assert watch.by_length(_batch(["a"], [2], [2], [4])) == []  # a's prompt done: 1st output
    assert watch.by_length(_batch(["a"], [4], [1], [4])) == []  # 2nd output
    assert watch.by_length(_batch(["a"], [5], [1], [4])) == ["a"]  # 3rd and last
    assert watch.by_length(_batch(["a"], [5], [1], [4])) == []  # told once
    assert watch.already_told({"a", "c"}) == {"a"}


def test_a_resumed_request_recomputing_its_outputs_finishes_at_the_same_position():
    watch = FinishWatch()
    watch.note_new(_req("a", max_tokens=4), prompt_len=4)
    # Preempted after 2 outputs; resumed: prefill_len 6 recomputed from 0 in one chunk (3rd output).
    assert watch.by_length(_batch(["a"], [0], [6], [6])) == []
    assert watch.by_length(_batch(["a"], [6], [1], [6])) == ["a"]  # 4th output


def test_length_detection_off_and_stop_tokens_at_shutdown():
    off = FinishWatch(length_detection=False)
    off.note_new(_req("a", max_tokens=1), prompt_len=2)
    assert off.by_length(_batch(["a"], [0], [2], [2])) == []
    watch = FinishWatch()
    watch.note_new(_req("a", 9, eos=2), prompt_len=2)
    watch.note_new(_req("b", 9, eos=None, stop=[7]), prompt_len=2)
    watch.note_new(_req("c", 9, eos=None), prompt_len=2)  # ignore_eos: eos_token_id is None
    out = SimpleNamespace(req_ids=["a", "b", "c"], sampled_token_ids=[[2], [7], [2]])
    watch.note_sampled(out)
    assert watch.stopped_by_token() == {"a", "b"}


def test_a_steady_decode_batch_finishes_each_request_in_its_own_step():
    # The watch keeps the batch's last positions while its rows stay the same requests: each row
    # still finishes in the step that samples its last token, also after the rows changed.
    watch = FinishWatch()
    watch.note_new(_req("a", 3), 2)
    watch.note_new(_req("b", 5), 2)
    ids = ["a", "b"]
    assert watch.by_length(_batch(ids, [0, 0], [2, 2], [2, 2])) == []  # prompts: 1st outputs
    assert watch.by_length(_batch(ids, [2, 2], [1, 1], [2, 2])) == []
    assert watch.by_length(_batch(ids, [3, 3], [1, 1], [2, 2])) == ["a"]  # a's 3rd output
    watch.already_told({"a"})
    assert watch.by_length(_batch(["b"], [4], [1], [2])) == []
    watch.note_new(_req("c", 1), 2)
    assert watch.by_length(_batch(["b", "c"], [5, 0], [1, 2], [2, 2])) == ["b", "c"]
