"""A generation-only code2wav stage on real vLLM V2 (CPU) + the shim + a real `omni-code2wav` sidecar.

Three requests of different lengths run together, fed chunk by chunk (one chunk per step, left
context prepended and cut off), two with the sidecar's chunking and one with its own (a left
context shorter than the decoder's receptive field). Each request's assembled waveform must
equal a direct forward of the same weights (the checkpoint's decoder, no vLLM) on the same
chunks; it streams per step; and where the left context covers the receptive field, it also
equals one decode of the whole sequence.
"""

from __future__ import annotations

import pytest
import torch

from tests.support.procs import ROOT, SidecarProcess, run_engine

pytestmark = pytest.mark.e2e
CHUNK, LEFT = 4, 8  # the sidecar's options; LEFT covers the tiny decoder's receptive field (9 frames)
REQUESTS = [
    {"frames": 13, "seed": 1, "chunk_frames": CHUNK, "left_context": LEFT},
    {"frames": 6, "seed": 2, "chunk_frames": CHUNK, "left_context": LEFT},
    {"frames": 11, "seed": 3, "chunk_frames": 5, "left_context": 2, "in_payload": True},
]
ATOL = 1e-5


@pytest.fixture(scope="module")
def code2wav_model(tmp_path_factory):
    from tests.tiny_models.code2wav import build_tiny_code2wav

    return str(build_tiny_code2wav(tmp_path_factory.mktemp("tiny-code2wav")))


@pytest.fixture(scope="module")
def code2wav_run(code2wav_model, tmp_path_factory):
    work = tmp_path_factory.mktemp("code2wav")
    endpoint = f"ipc://{work}/sc.sock"
    sidecar = SidecarProcess(endpoint, "omni-code2wav", work / "sidecar.log",
                             options=[f"chunk_frames={CHUNK}", f"left_context={LEFT}"])
    try:
        res = run_engine(
            {"model": code2wav_model, "endpoint": endpoint, "requests": REQUESTS,
             "llm_kwargs": {"max_model_len": 64, "max_num_batched_tokens": 64, "max_num_seqs": 4}},
            work, "code2wav", script=ROOT / "tests" / "support" / "code2wav_job.py", timeout_s=300,
        )
    finally:
        sidecar.stop()
    assert res["ok"], res.get("traceback")
    return res


def direct_chunked_decode(decoder, codes: torch.Tensor, chunk: int, left: int) -> list[torch.Tensor]:
    """The reference, written out here: each chunk decoded alone with its left context, context cut."""
    spf, out = decoder.samples_per_frame, []
    with torch.no_grad():
        for start in range(0, codes.shape[0], chunk):
            first = max(0, start - left)
            wave = decoder(codes[first : start + chunk].t().unsqueeze(0))[0]
            out.append(wave[(start - first) * spf :])
    return out


def test_code2wav_audio_equals_a_direct_forward_on_the_same_chunks(code2wav_run, code2wav_model):
    from tests.support.code2wav_payload import request_codes
    from tests.tiny_models.code2wav import CODE2WAV_CONFIG, load_decoder

    decoder = load_decoder(code2wav_model)
    spf = decoder.samples_per_frame
    worst = 0.0
    for i, spec in enumerate(REQUESTS):
        codes = request_codes(spec["frames"], spec["seed"])
        chunks = direct_chunked_decode(decoder, codes, spec["chunk_frames"], spec["left_context"])
        reference = torch.cat(chunks)
        got = code2wav_run["finals"][i]
        wave = torch.tensor(got["waveform"])
        assert wave.shape == (spec["frames"] * spf,), f"request {i}"
        worst = max(worst, float((wave - reference).abs().max()))
        torch.testing.assert_close(wave, reference, atol=ATOL, rtol=0, msg=f"request {i}")
        assert got["sr"] == CODE2WAV_CONFIG["output_sample_rate"]
        # Streamed per step: one chunk per step, each equal to its chunk of the direct forward.
        streamed = [torch.tensor(c) for c in code2wav_run["streams"][i]]
        assert [c.shape[0] for c in streamed] == [c.shape[0] for c in chunks]
        for got_chunk, ref_chunk in zip(streamed, chunks):
            torch.testing.assert_close(got_chunk, ref_chunk, atol=ATOL, rtol=0)
        # While it ran, the sidecar's waveform grew by one chunk per step. (A step's results travel
        # asynchronously: a query right after step k may still miss chunk k, never chunk k - 1, since
        # step k's blocking exchange came after step k - 1's results.)
        held = [sum(c.shape[0] for c in chunks[:k]) for k in range(len(chunks) + 1)]
        growth = code2wav_run["growth"][i]
        assert len(growth) == len(chunks) - 1
        assert all(held[k] <= g <= held[k + 1] for k, g in enumerate(growth)), (growth, held)
        # Generation-only: one step per chunk, the sampled tokens only counted.
        assert len(code2wav_run["tokens"][i]) == len(chunks)
        full = decoder(codes.t().unsqueeze(0))[0].detach()
        if spec["left_context"] >= decoder.receptive_frames - 1:
            torch.testing.assert_close(wave, full, atol=ATOL, rtol=0)
        else:  # too little left context: the chunk seams differ from one whole decode
            assert float((wave - full).abs().max()) > 1e-3
    print(f"code2wav: max |vLLM V2 + shim + sidecar - direct forward| = {worst:.3g}")
    (shim,) = code2wav_run["shim_stats"]
    assert shim["request_errors"] == {}
    # The chunk reaches the forward through the step's one blocking exchange (every step).
    assert shim["blocking_exchanges"] == shim["steps"]
