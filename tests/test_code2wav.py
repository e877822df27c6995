"""The code2wav stage without vLLM: chunk and left-context math, the `omni-code2wav` hook set fed
step by step as the shim would (positions, batch order), the model side of each step played by the
tiny decoder itself, and the assembled waveform compared with decodes done by hand."""

from __future__ import annotations

import pytest
import torch

from omni_sidecar.hook_api.hook_set import HookErrors, RequestInfo, StepBatch
from omni_sidecar.hook_sets.omni.code2wav import Code2WavHooks, chunk_input, chunk_span, num_chunks
from omni_sidecar.hook_sets.omni.wire import encode_additional_information
from proto.packed import StepLayout
from tests.tiny_models.code2wav import CODE2WAV_CONFIG, Code2WavDecoder, decode_runtime_info

Q = CODE2WAV_CONFIG["num_quantizers"]


@pytest.fixture(scope="module")
def decoder():
    from transformers import Qwen3Config

    torch.manual_seed(0)
    return Code2WavDecoder(Qwen3Config(**CODE2WAV_CONFIG)).eval()


def codes(frames: int, seed: int) -> torch.Tensor:
    return torch.randint(0, CODE2WAV_CONFIG["codebook_size"], (frames, Q), generator=torch.Generator().manual_seed(seed))


def whole(decoder, c: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return decoder(c.t().unsqueeze(0))[0]


def test_chunks_and_their_left_context():
    assert [num_chunks(f, 4) for f in (1, 4, 5, 13)] == [1, 1, 2, 4]
    assert [chunk_span(k, 13, 4, 8) for k in range(5)] == [(0, 0, 4), (0, 4, 8), (0, 8, 12), (4, 12, 13), None]
    assert chunk_span(2, 13, 4, 2) == (6, 8, 12) and chunk_span(1, 13, 4, 0) == (4, 4, 8)
    assert chunk_span(-1, 13, 4, 8) is None
    c = codes(13, 1)
    info = chunk_input(c, 3, 4, 8)
    assert info["meta"]["left_context_size"] == 8
    # vllm-omni's layout: flat and codebook-major, frames [4, 13).
    assert torch.equal(info["codes"]["audio"].reshape(Q, -1), c[4:13].t())
    assert chunk_input(c, 4, 4, 8) is None


def test_left_context_covering_the_receptive_field_gives_the_whole_decode(decoder):
    c = codes(17, 2)
    full = whole(decoder, c)
    assert decoder.receptive_frames == 9
    for chunk, left, equal in [(4, 8, True), (3, 12, True), (17, 0, True), (4, 2, False), (5, 0, False)]:
        waves = [decode_runtime_info(decoder, chunk_input(c, k, chunk, left)) for k in range(num_chunks(17, chunk))]
        assert [w.shape[0] for w in waves] == [min(chunk, 17 - k * chunk) * decoder.samples_per_frame
                                               for k in range(len(waves))]
        diff = float((torch.cat(waves) - full).abs().max())
        assert (diff < 1e-5) == equal, (chunk, left, diff)


def test_a_shorter_first_chunk_moves_every_later_chunk_and_keeps_the_whole_decode(decoder):
    from proto.chunk_grid import ChunkGrid

    grid = ChunkGrid(4, initial=1)
    assert [(grid.start(k), grid.end(k)) for k in range(4)] == [(0, 1), (1, 5), (5, 9), (9, 13)]
    assert [grid.count(f) for f in (0, 1, 2, 5, 6, 13)] == [0, 1, 2, 2, 3, 4]
    assert [grid.complete(f) for f in (0, 1, 4, 5, 9)] == [0, 1, 1, 2, 3]
    assert grid.ready(1, 3, final=True) and not grid.ready(1, 3, final=False) and grid.ready(1, 5, final=False)
    assert [grid.span(k, 11, 8) for k in range(5)] == [(0, 0, 1), (0, 1, 5), (0, 5, 9), (1, 9, 11), None]
    assert ChunkGrid(4).first == ChunkGrid(4, initial=4).first == 4
    with pytest.raises(ValueError):
        ChunkGrid(0)
    c = codes(17, 3)
    full = whole(decoder, c)
    for initial in (1, 2, 6):
        n = num_chunks(17, 4, initial)
        waves = [decode_runtime_info(decoder, chunk_input(c, k, 4, 8, initial)) for k in range(n)]
        assert waves[0].shape[0] == initial * decoder.samples_per_frame
        assert float((torch.cat(waves) - full).abs().max()) < 1e-5, initial


def layout(rows: list[tuple[str, int, int]], prefill_lens: list[int] | None = None) -> StepLayout:
    """rows: (request, computed tokens, scheduled rows)."""
    qsl = [0]
    for _, _, n in rows:
        qsl.append(qsl[-1] + n)
    return StepLayout([r for r, _, _ in rows], qsl, [nc for _, nc, _ in rows], prefill_lens or [1] * len(rows))


def request(req_id: str, info: dict) -> RequestInfo:
    return RequestInfo(req_id, 1, [1], payload={"additional_information": encode_additional_information(info)})


def run_step(hooks: Code2WavHooks, decoder, step: int, lay: StepLayout) -> list[dict]:
    """One step as the shim plays it: the plan's runtime info in batch order, the model's
    per-request outputs (vllm-omni's `model_outputs`, `sr`) back with the StepEnd."""
    infos = hooks.build_extra_kwargs(StepBatch(step, lay))["runtime_additional_information"]
    assert len(infos) == len(lay.req_ids)
    outputs = {}
    for req_id, info in zip(lay.req_ids, infos):
        wave = decode_runtime_info(decoder, info)
        if wave is not None:
            outputs[req_id] = {"model_outputs": wave, "sr": torch.tensor(300, dtype=torch.int32)}
    hooks.on_model_results({}, outputs)
    return infos


def test_the_hook_set_feeds_one_chunk_per_step_and_assembles_each_request(decoder):
    hooks = Code2WavHooks(chunk_frames="4", left_context="8")
    ca, cb = codes(13, 3), codes(6, 4)
    hooks.on_new_requests([request("a", {"codes": {"audio": ca}}),
                           request("b", {"codes": {"audio": cb},
                                         "meta": {"codec_chunk_frames": 3, "codec_left_context_frames": 1}})])
    assert hooks.model_states(["a", "b", "x"]) == {"a": {}, "b": {}}  # the model's mirror needs no codes
    # Step 0 prefills both (position 0: chunk 0); a request without a payload sits in between.
    infos = run_step(hooks, decoder, 0, layout([("a", 0, 1), ("plain", 0, 3), ("b", 0, 1)], [1, 3, 1]))
    assert infos[1] == {} and infos[2]["meta"]["left_context_size"] == 0
    for step in range(1, 4):
        rows = [("a", step, 1)] + ([("b", step, 1)] if step < num_chunks(6, 3) else [])
        infos = run_step(hooks, decoder, step, layout(rows))
        if step == 1:
            assert infos[1]["meta"]["left_context_size"] == 1
    assert run_step(hooks, decoder, 4, layout([("a", 4, 1)])) == [{}]  # past its last chunk: nothing
    got_a, got_b = hooks.get_outputs("a"), hooks.get_outputs("b")
    assert got_a["waveform"].shape == (13 * decoder.samples_per_frame, 1) and int(got_a["sr"]) == 300
    torch.testing.assert_close(got_a["waveform"].reshape(-1), whole(decoder, ca), atol=1e-5, rtol=0)
    # b: chunks of 3 with 1 frame of left context, by hand.
    with torch.no_grad():
        by_hand = [decoder(cb[max(0, s - 1) : s + 3].t().unsqueeze(0))[0][(s - max(0, s - 1)) * 24 :]
                   for s in (0, 3)]
    torch.testing.assert_close(got_b["waveform"].reshape(-1), torch.cat(by_hand), atol=1e-6, rtol=0)
    assert [c["waveform"].shape[0] for c in hooks.output_chunks("a")] == [96, 96, 96, 24]  # streamed per step


def test_a_recomputed_request_gets_the_chunk_of_the_position_it_reaches(decoder):
    hooks = Code2WavHooks(chunk_frames="2", left_context="2")
    c = codes(8, 5)
    hooks.on_new_requests([request("r", {"codes": {"audio": c}})])
    run_step(hooks, decoder, 0, layout([("r", 0, 1)]))
    hooks.on_preempted(["r"])
    hooks.on_new_requests([request("r", {"codes": {"audio": c}})])  # V2 re-adds it, state kept
    # Recomputed from position 0 with its generated token: rows 0..1, the last one is chunk 1's.
    infos = run_step(hooks, decoder, 1, layout([("r", 0, 2)], [2]))
    assert torch.equal(infos[0]["codes"]["audio"].reshape(Q, -1), c[0:4].t())
    for k in (2, 3):
        run_step(hooks, decoder, k, layout([("r", k, 1)]))
    torch.testing.assert_close(hooks.get_outputs("r")["waveform"].reshape(-1),
                               torch.cat([decode_runtime_info(decoder, chunk_input(c, k, 2, 2)) for k in range(4)]),
                               atol=0, rtol=0)


def test_the_state_goes_on_in_a_hot_upgraded_successor(decoder):
    old, new = Code2WavHooks(chunk_frames="3", left_context="8"), Code2WavHooks(chunk_frames="3", left_context="8")
    c = codes(7, 6)
    old.on_new_requests([request("u", {"codes": {"audio": c}})])
    run_step(old, decoder, 0, layout([("u", 0, 1)]))
    new.import_state(old.export_state())
    for k in (1, 2):
        run_step(new, decoder, k, layout([("u", k, 1)]))
    torch.testing.assert_close(new.get_outputs("u")["waveform"].reshape(-1), whole(decoder, c), atol=1e-5, rtol=0)


def test_bad_payloads_and_outputs_fail_only_their_request(decoder):
    hooks = Code2WavHooks(chunk_frames="4", left_context="0")
    with pytest.raises(HookErrors) as err:
        hooks.on_new_requests([
            request("ok", {"codes": {"audio": codes(5, 7)}}),
            request("none", {"meta": {"x": 1}}),
            request("float", {"codes": {"audio": torch.zeros(5, Q)}}),
            request("flat", {"codes": {"audio": torch.zeros(5, dtype=torch.long)}}),
            request("chunk0", {"codes": {"audio": codes(5, 8)}, "meta": {"codec_chunk_frames": 0}}),
        ])
    assert set(err.value.errors) == {"none", "float", "flat", "chunk0"}
    assert "codes.audio" in err.value.errors["none"] and "integer" in err.value.errors["float"]
    assert hooks.model_states(["ok", "float"]) == {"ok": {}}
    with pytest.raises(HookErrors) as err:
        hooks.on_model_results({}, {"ok": {"model_outputs": torch.zeros(2, 3)}})
    assert set(err.value.errors) == {"ok"} and "1-dim" in err.value.errors["ok"]
    with pytest.raises(ValueError):
        Code2WavHooks(chunk_frames="0")


def append(hooks: Code2WavHooks, req_id: str, info: dict) -> None:
    import msgspec

    hooks.on_payload_appended(req_id, msgspec.msgpack.encode(encode_additional_information(info)))


def test_streamed_codes_wait_for_their_chunk_and_end_equal_to_codes_given_up_front(decoder, caplog):
    """Frames arrive while the request runs (appends replace codes.audio): a step whose next chunk
    is incomplete decodes nothing, the chunk goes to a later step, a step seen again gets the same
    chunk, and the final flag releases the short last chunk; the waveform equals the up-front one."""
    c = codes(10, 7)
    hooks = Code2WavHooks(chunk_frames="4", left_context="8")
    hooks.on_new_requests([request("s", {"codes": {"audio": c[:0]}, "meta": {"codec_streaming": True}})])
    arrived = {0: 3, 1: 4, 3: 9, 5: 10}  # frames there before step t (and 8 after step 2)
    decoded = []
    for step in range(8):
        if step in arrived:
            append(hooks, "s", {"codes": {"audio": c[: arrived[step]]}})
        if step == 5:
            append(hooks, "s", {"meta": {"codec_final": True}})
        info = run_step(hooks, decoder, step, layout([("s", step, 1)]))[0]
        decoded.append(info["meta"]["left_context_size"] if info else None)
        if step == 2:  # the same step again (a replay) gets what it got, though chunk 1 is there now
            append(hooks, "s", {"codes": {"audio": c[:8]}})
            assert run_step(hooks, decoder, step, layout([("s", step, 1)]))[0] == {}
    # step 0: 3 frames < chunk 0's 4 -> nothing; 1: chunk 0; 2: 4 frames, chunk 1 needs 8 -> nothing;
    # 3: chunk 1 (9 frames); 4: chunk 2 needs 12, not final -> nothing; 5: final -> chunk 2 (frames 8..10)
    assert decoded == [None, 0, None, 4, None, 8, None, None]
    torch.testing.assert_close(hooks.get_outputs("s")["waveform"].reshape(-1), whole(decoder, c), atol=1e-5, rtol=0)
    with pytest.raises(HookErrors, match="integer"):
        append(hooks, "s", {"codes": {"audio": torch.zeros(12, Q)}})
    with caplog.at_level("WARNING", logger="omni_sidecar.code2wav"):
        hooks.on_finished(["s"])
    assert not caplog.records  # every chunk decoded


def test_a_step_seen_again_gets_the_chunk_it_got_and_a_short_clock_is_reported(decoder, caplog):
    c = codes(8, 8)
    hooks = Code2WavHooks(chunk_frames="4", left_context="0")
    hooks.on_new_requests([request("w", {"codes": {"audio": c[:4]}, "meta": {"codec_streaming": True}})])
    first = hooks.build_extra_kwargs(StepBatch(0, layout([("w", 0, 1)])))["runtime_additional_information"][0]
    again = hooks.build_extra_kwargs(StepBatch(0, layout([("w", 0, 1)])))["runtime_additional_information"][0]
    assert torch.equal(first["codes"]["audio"], again["codes"]["audio"])
    append(hooks, "w", {"codes": {"audio": c}})
    with caplog.at_level("WARNING", logger="omni_sidecar.code2wav"):
        hooks.on_finished(["w"])  # its clock ended before chunk 1 was decoded
    assert "1 of its chunks undecoded" in caplog.text


def test_a_request_without_a_payload_is_not_a_code2wav_request_and_no_error(decoder):
    """vLLM's own warm-up requests (0.26 on CUDA) come with no payload: passed over, not failed."""
    hooks = Code2WavHooks(chunk_frames="4", left_context="0")
    hooks.on_new_requests([RequestInfo("_warmup_0_", 1, [1]), request("a", {"codes": {"audio": codes(4, 9)}})])
    assert hooks.model_states(["_warmup_0_", "a"]) == {"a": {}}
    infos = run_step(hooks, decoder, 0, layout([("_warmup_0_", 0, 1), ("a", 0, 1)]))
    assert infos[0] == {} and infos[1]["meta"]["left_context_size"] == 0


def test_codes_outside_the_codebook_fail_their_request_not_the_step(decoder):
    hooks = Code2WavHooks(chunk_frames="4", left_context="0", codebook_size=str(CODE2WAV_CONFIG["codebook_size"]))
    bad = codes(4, 10)
    bad[2, 1] = CODE2WAV_CONFIG["codebook_size"]  # e.g. a talker's EOS written into a frame
    with pytest.raises(HookErrors) as err:
        hooks.on_new_requests([request("bad", {"codes": {"audio": bad}}), request("ok", {"codes": {"audio": codes(4, 11)}}),
                               request("s", {"codes": {"audio": codes(4, 12)}, "meta": {"codec_streaming": True}})])
    assert set(err.value.errors) == {"bad"} and "outside the codebook" in err.value.errors["bad"]
    with pytest.raises(HookErrors, match="outside the codebook"):
        append(hooks, "s", {"codes": {"audio": torch.cat([codes(4, 12), -bad[:1]])}})
    assert hooks.model_states(["bad", "ok", "s"]) == {"ok": {}, "s": {}}
