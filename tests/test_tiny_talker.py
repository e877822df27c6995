"""The tiny talker and its direct reference forward (no vLLM engine except the last test)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from tests.support.talker_payload import encoded_payload, talker_request
from tests.support.talker_reference import ReferenceTalker, reference_codes
from tests.tiny_models.talker import CODEC_EOS_ID, TALKER_CONFIG, build_tiny_talker

NUM_CODE_GROUPS = TALKER_CONFIG["num_code_groups"]
# (prompt rows, thinker rows, seed): thinker rows shorter than, equal to and longer than the prompt.
SHAPES = [(5, 12, 1), (9, 4, 2), (3, 3, 3), (17, 30, 4), (1, 6, 5)]


@pytest.fixture(scope="module")
def talker_dir(tmp_path_factory):
    return build_tiny_talker(tmp_path_factory.mktemp("tiny-talker"))


@pytest.fixture(scope="module")
def reference(talker_dir):
    return ReferenceTalker(talker_dir)


def _requests(max_tokens: int = 20, ignore_eos: bool = True) -> list[dict]:
    return [{**talker_request(p, t, s, max_tokens), "ignore_eos": ignore_eos} for p, t, s in SHAPES]


def test_weights_build_deterministically(talker_dir, tmp_path):
    again = load_file(str(build_tiny_talker(tmp_path / "again") / "model.safetensors"))
    first = load_file(str(talker_dir / "model.safetensors"))
    assert first.keys() == again.keys()
    assert any(k.startswith("heads.") for k in first) and any(k.startswith("model.") for k in first)
    assert all(torch.equal(first[k], again[k]) for k in first)
    other = load_file(str(build_tiny_talker(tmp_path / "other", seed=1) / "model.safetensors"))
    assert not torch.equal(first["heads.codec_head.weight"], other["heads.codec_head.weight"])


def test_reference_is_deterministic_and_shaped(talker_dir, reference):
    requests = _requests()
    first = [reference.generate(r) for r in requests]
    again = reference_codes(talker_dir, requests)
    for a, b, request in zip(first, again, requests):
        assert a["tokens"] == b["tokens"] and torch.equal(a["codes"], b["codes"])
        assert len(a["tokens"]) == request["max_tokens"]
        assert a["codes"].shape == (request["max_tokens"] - 1, NUM_CODE_GROUPS)
        # a decode step's code 0 is the code sampled by the step before it (0 for one outside codebook 0)
        size = TALKER_CONFIG["codebook_size"]
        assert a["codes"][:, 0].tolist() == [t if t < size else 0 for t in a["tokens"][:-1]]
        assert a["codes"].max() < size


def test_stops_at_eos(reference):
    outs = [reference.generate(r) for r in _requests(max_tokens=40, ignore_eos=False)]
    stopped = [o for o in outs if o["tokens"][-1] == CODEC_EOS_ID]
    assert stopped, "no request sampled EOS within 40 steps; pick other seeds"
    for out in stopped:
        assert CODEC_EOS_ID not in out["tokens"][:-1]
        assert out["codes"].shape[0] == len(out["tokens"]) - 1


def test_argmax_margins_are_clear(reference):
    """Every greedy choice (code 0 and each residual code) wins by a margin far above fp32 noise."""
    gaps = [reference.generate(r)["min_gap"] for r in _requests(max_tokens=40)]
    print(f"smallest top1-top2 logit gap per request: {['%.3g' % g for g in gaps]}")
    assert min(gaps) > 1e-5


def test_codes_follow_the_previous_codes_and_the_text_rows(reference):
    """A thinker row read at decode step k changes no code up to step k, and changes later codes."""
    prompt_len, step = 5, 3
    base = talker_request(prompt_len, 12, 7, max_tokens=24)
    base["ignore_eos"] = True
    changed = {**base, "info": {**base["info"], "hidden_states": {
        "output": base["info"]["hidden_states"]["output"].clone()}}}
    changed["info"]["hidden_states"]["output"][prompt_len + step] += 1.0
    a, b = reference.generate(base)["codes"], reference.generate(changed)["codes"]
    assert torch.equal(a[: step + 1], b[: step + 1])
    assert not torch.equal(a[step + 1 :], b[step + 1 :])
    # a prompt row's thinker row reaches the very first code
    prompt_changed = {**base, "info": {**base["info"], "hidden_states": {
        "output": base["info"]["hidden_states"]["output"].clone()}}}
    prompt_changed["info"]["hidden_states"]["output"][1] += 1.0
    c = reference.generate(prompt_changed)
    assert not torch.equal(a, c["codes"])


@pytest.mark.parametrize("chunk", [1, 2, 7])
def test_chunked_prefill_gives_the_same_codes(reference, chunk):
    for request in _requests():
        whole, chunked = reference.generate(request), reference.generate(request, prefill_chunk=chunk)
        assert whole["tokens"] == chunked["tokens"]
        assert torch.equal(whole["codes"], chunked["codes"])


def test_decode_batch_preprocess_equals_the_per_request_path(reference):
    hidden = TALKER_CONFIG["hidden_size"]
    infos = []
    for i, (prompt_len, text_len, seed) in enumerate(SHAPES):
        info = talker_request(prompt_len, text_len, seed)["info"]
        info = {**info, "_omni_prompt_len": prompt_len, "_omni_num_computed_tokens": 0, "_omni_is_prefill": True}
        _, _, update = reference.preprocess(torch.full((prompt_len,), 66), None, **info)
        assert update == {"meta": {"text_pos": 0}}
        state = {**info, "hidden_states": {**info["hidden_states"], "last": torch.randn(1, hidden)}}
        # text_pos inside and past the thinker rows
        state["meta"] = {"text_pos": i % 3 if i % 2 else text_len + 1}
        state.update({"_omni_num_computed_tokens": prompt_len + 4, "_omni_is_prefill": False})
        infos.append(state)
    ids = torch.tensor([3, 17, CODEC_EOS_ID, 0, 63])
    with torch.inference_mode():
        batch = reference.preprocess_decode_batch(input_ids=ids, req_infos=infos)
        singles = [reference.preprocess(ids[i : i + 1], None, **info) for i, info in enumerate(infos)]
    out_ids, embeds, last, text, updates = batch
    assert torch.equal(out_ids, ids)
    for i, (one_ids, one_embeds, update) in enumerate(singles):
        mtp_last, mtp_text = update.pop("mtp_inputs")
        assert torch.equal(one_ids, ids[i : i + 1])
        assert torch.equal(embeds[i : i + 1], one_embeds)
        assert torch.equal(last[i : i + 1], mtp_last) and torch.equal(text[i : i + 1], mtp_text)
        assert updates[i] == update


def test_payload_is_vllm_omni_entries(reference):
    from omni_sidecar.hook_sets.omni.wire import decode_additional_information

    request = talker_request(4, 10, 11)
    payload = encoded_payload(request["info"])
    assert set(payload["entries"]) == {"hidden_states.output", "embed.tts_pad"}
    decoded = decode_additional_information(payload)
    assert torch.equal(decoded["hidden_states"]["output"], request["info"]["hidden_states"]["output"])
    assert torch.equal(decoded["embed"]["tts_pad"], request["info"]["embed"]["tts_pad"])
    assert reference.generate({**request, "info": decoded})["tokens"] == reference.generate(request)["tokens"]


def test_payload_files_load_as_an_engine_job_payload(tmp_path):
    from omni_sidecar.hook_sets.omni.wire import decode_additional_information
    from tests.support.engine_job import _load_payload
    from tests.support.talker_payload import payload_files

    info = talker_request(4, 10, 12, dtype=torch.bfloat16)["info"]
    loaded = _load_payload(payload_files(info, tmp_path, "req0"))
    decoded = decode_additional_information(loaded["additional_information"])
    for category, key in (("hidden_states", "output"), ("embed", "tts_pad")):
        assert decoded[category][key].dtype == torch.bfloat16
        assert torch.equal(decoded[category][key], info[category][key])


@pytest.mark.parametrize("mp", [0, pytest.param(1, marks=pytest.mark.slow)])
def test_plain_vllm_loads_and_generates_what_the_direct_forward_does(talker_dir, tmp_path, reference, mp):
    """A real vLLM V2 engine, no shim: the checkpoint loads into the model class (backbone and heads).

    mp=1: the engine and its worker are spawned processes, registered by the job script's import.
    """
    from pathlib import Path

    from tests.support.procs import run_engine

    # 81 rows > max_num_batched_tokens=64: vLLM prefills that prompt in two chunks
    prompts = [[64, 66, 66, 66, 66], [64] + [66] * 80, list(range(3, 21))]
    result = run_engine({"model": str(talker_dir), "prompts": prompts, "max_tokens": 12, "mp": mp}, tmp_path,
                        f"talker-plain-{mp}", script=Path(__file__).parent / "support" / "talker_plain_job.py")
    assert result["ok"], result.get("traceback")
    for prompt, tokens, logprobs in zip(prompts, result["tokens"], result["logprobs"]):
        want_tokens, want_logprobs = reference.plain_greedy(prompt, 12)
        assert tokens == want_tokens
        assert logprobs == pytest.approx(want_logprobs, abs=1e-5)  # seen: 2e-6


def test_thinker_rows_streamed_as_embed_decode_read_as_rows_given_up_front(reference):
    """A decode step reads thinker row `text_pos` past the prompt: from `hidden_states.output` when
    the payload had it, from the streamed `embed.decode` span otherwise; tts_pad past both."""
    prompt_len, text_len = 4, 5  # thinker rows: the prompt's, then text_len generated ones
    info = talker_request(prompt_len, prompt_len + text_len, 7)["info"]
    rows = info["hidden_states"]["output"]
    up_front = {**info, "_omni_prompt_len": prompt_len}
    streamed = {**info, "_omni_prompt_len": prompt_len,
                "hidden_states": {"output": rows[:prompt_len]},
                "embed": {**info["embed"], "decode": rows[prompt_len:], "decode_token_start": 0,
                          "decode_token_end": text_len}}
    pad = reference.heads.project_text(info["embed"]["tts_pad"].reshape(1, -1))
    with torch.inference_mode():
        for pos in range(text_len + 2):
            a, update = reference.heads.next_text_step({**up_front, "meta": {"text_pos": pos}})
            b, _ = reference.heads.next_text_step({**streamed, "meta": {"text_pos": pos}})
            assert update == {"meta": {"text_pos": pos + 1}}
            assert torch.equal(a, b), pos
            assert torch.equal(a, pad) == (pos >= text_len), pos
