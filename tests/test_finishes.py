"""The shim's own finish detection (worker_shim/step/finishes.py), on fake vLLM batches."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from worker_shim.step.finishes import FinishWatch


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
    watch.note_sampled(7, out)
    assert watch.stopped_by_token() == ({"a", "b"}, [])


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


def _simulate(seed: int, steps: int = 600) -> tuple[int, int]:
    """A small scheduler over random requests (chunked prefill, steady decode, preemption with
    recompute, a running request sent back by a failed KV load, rows reordered, steps the watch does
    not see), the watch checked every step against the definition: a row finishes in the step whose computed count reaches prompt + max_tokens - 1
    with its prefill done, once. Returns (steps compared, whole-batch comparisons the watch made)."""
    rng = np.random.default_rng(seed)
    watch = FinishWatch()
    live: list[dict] = []  # in row order
    waiting: list[dict] = []  # preempted, to resume
    next_id, compared, told_late = 0, 0, set()
    for _ in range(steps):
        if len(live) + len(waiting) < 12 and rng.random() < 0.15:
            req = {"id": f"r{next_id}", "P": int(rng.integers(1, 9)), "M": int(rng.integers(1, 60))}
            req.update(c=0, prefill=req["P"])
            next_id += 1
            watch.note_new(_req(req["id"], req["M"]), req["P"])
            live.append(req)
        if waiting and rng.random() < 0.2:
            live.append(waiting.pop(0))
        if live and rng.random() < 0.02:  # preempted: recomputes prompt and outputs when resumed
            req = live.pop(int(rng.integers(len(live))))
            outputs = max(0, req["c"] - req["P"] + 1)
            req.update(c=0, prefill=req["P"] + outputs)
            waiting.append(req)
        decoding = [r for r in live if r["c"] >= r["prefill"]]
        if decoding and rng.random() < 0.03:  # a failed KV load: sent back, kept in the batch, recomputed
            req = decoding[int(rng.integers(len(decoding)))]
            req.update(prefill=req["c"] + 1, c=req["c"] - int(rng.integers(1, req["c"] + 1)))
        if rng.random() < 0.02:
            rng.shuffle(live)
        if not live:
            continue
        ids = [r["id"] for r in live]
        sched = []
        for r in live:
            left = r["prefill"] - r["c"]
            sched.append(1 if left <= 0 else int(rng.integers(1, left + 1)) if rng.random() < 0.5 else left)
        batch = _batch(list(ids), np.array([r["c"] for r in live], dtype=np.int32), sched,
                       np.array([r["prefill"] for r in live], dtype=np.int32))
        want = [r["id"] for r, k in zip(live, sched)
                if r["c"] + k >= max(r["P"] + r["M"] - 1, r["prefill"])]
        if rng.random() < 0.03:  # a step the watch does not see (the link without a sidecar)
            watch.forget_rows()
            told_late.update(want)
        else:
            assert watch.by_length(batch) == want, (seed, ids, want)
            compared += 1
        for r, k in zip(live, sched):
            r["c"] += k
        finished = set(want)
        live = [r for r in live if r["id"] not in finished]
        watch.already_told(finished)  # vLLM's notice, the next step
    return compared, watch.batch_compares


def test_the_length_watch_agrees_with_the_definition_over_random_schedules():
    for seed in range(8):
        compared, whole = _simulate(seed)
        assert compared > 300
        assert whole < 0.8 * compared  # the steady shortcut was taken, and checked, on many of those steps


def test_a_steady_decode_batch_is_compared_whole_once_until_a_row_nears_its_end():
    watch = FinishWatch()
    ids = [f"r{i}" for i in range(64)]
    for i, r in enumerate(ids):
        watch.note_new(_req(r, 100 + i), 4)  # r0's last sample: computed 4 + 100 - 1 = 103 after its step
    assert watch.by_length(_batch(ids, [0] * 64, [4] * 64, [4] * 64)) == []  # prefill: compared whole
    before = watch.batch_compares
    for c in range(4, 102):  # steady decode, no row at its last step yet: one comparison, then reads
        assert watch.by_length(_batch(ids, [c] * 64, [1] * 64, [4] * 64)) == []
    assert watch.batch_compares == before + 1
    assert watch.by_length(_batch(ids, [102] * 64, [1] * 64, [4] * 64)) == ["r0"]  # computed 103 after it


def test_a_step_the_watch_did_not_see_ends_its_steady_shortcut():
    # b resumes after preemption (prompt 4 + 5 outputs recomputed: prefill 9), one token at a time,
    # next to a decoding: a steady-looking batch. A step the link could not show the watch moves b
    # eight tokens; b's 8th and last output (computed 11 after its step) comes two steps later.
    watch = FinishWatch()
    watch.note_new(_req("a", 100), 4)
    watch.note_new(_req("b", 8), 4)
    assert watch.by_length(_batch(["a", "b"], [10, 0], [1, 1], [4, 9])) == []
    watch.forget_rows()  # the step [11, 1] + [1, 8] went by unseen
    assert watch.by_length(_batch(["a", "b"], [12, 9], [1, 1], [4, 9])) == []
    assert watch.by_length(_batch(["a", "b"], [13, 10], [1, 1], [4, 9])) == ["b"]


def test_a_row_sent_back_while_it_stays_in_the_batch_does_not_hide_another_rows_finish():
    # vLLM's recompute after a failed KV load moves a running request's count back and keeps it in
    # the batch: row a goes back 3 tokens at the sixth step; b's 26th and last output (computed 29
    # after its step) comes at the ninth, whatever the first row's count says.
    watch = FinishWatch()
    watch.note_new(_req("a", 100), 4)
    watch.note_new(_req("b", 26), 4)
    for i in range(9):
        a = 20 + i - (3 if i >= 5 else 0)
        got = watch.by_length(_batch(["a", "b"], [a, 20 + i], [1, 1], [4, 4]))
        assert got == (["b"] if i == 8 else []), i
