"""vllm-omni 0.26's Qwen3-Omni stages on vLLM 0.26's V2 through the shim, on CPU: the H200 driver's
pipeline (deploy/gpu/qwen3_omni_parity.py --kinds shim --cpu) as far as CPU goes.

It runs beside vllm-omni 0.26 on vLLM 0.26 (tests/support/paired_vllm_omni.py); elsewhere it is
skipped, saying why. Three V2 engines, one per stage (its registered stage class, vllm-omni's
outer class underneath), each with its sidecar; vllm-omni's own hand-over functions between them:
- code2wav alone (random codes): vllm-omni's decoder through the stage's clock gives transformers'
  `Qwen3OmniMoeCode2Wav` waveform on the same codes and weights;
- the thinker (MoE, M-RoPE) runs every request, its captured layers 0 and 24 reach vllm-omni's
  thinker -> talker hand-over, and the talker's prefill (vllm-omni's preprocess) runs on them and
  samples its first token, returned with its top-2 logprobs (what the parity report reads);
- text + image requests (one generated image) through the thinker's multimodal path, where the
  checkpoint has its processor files: its builder needs torchvision, which this CPU venv leaves out
  (skipped then, saying so);
- the talker's decode steps (its code predictor eager on the shim's CPU platform for vllm-omni,
  worker_shim/omni_models/cpu_platform.py) and code2wav: every request's waveform is transformers'
  decoder on the codes vllm-omni's hand-over took from the talker;
- no vllm-omni patch in the driver or any engine.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.support.paired_vllm_omni import build_tiny_qwen3_omni, paired_pythonpath, skip_unless_paired
from tests.support.procs import ROOT, child_env

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    skip_unless_paired()
    work = tmp_path_factory.mktemp("qwen3-omni-pipeline")
    env = child_env(PYTHONPATH=paired_pythonpath())
    build_tiny_qwen3_omni(work / "model")
    driver = subprocess.run([sys.executable, str(ROOT / "deploy" / "gpu" / "qwen3_omni_parity.py"), "--model",
                             str(work / "model"), "--out", str(work / "run"), "--kinds", "shim", "--cpu",
                             "--concurrency", "8", "--limit-s", "600"], env=env, capture_output=True, text=True,
                            timeout=700)
    report = work / "run" / "qwen3-omni-report.json"
    assert report.is_file(), driver.stdout[-3000:] + driver.stderr[-3000:]
    return {**json.loads(report.read_text()), "model": str(work / "model")}


def test_no_vllm_omni_patch_in_any_engine(run):
    shim = run["results"]["shim"]
    assert run["summary"]["vllm_omni_patches_applied"] == []
    assert shim["patches"]["process"] == []
    assert shim["patches"]["workers"] == {"thinker": [[]], "talker": [[]], "code2wav": [[]]}


def test_code2wav_stage_equals_transformers(run):
    from safetensors.torch import load_file
    from transformers import AutoConfig
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeCode2Wav

    direct = run["results"]["shim"]["code2wav_direct"]
    config = AutoConfig.from_pretrained(run["model"]).code2wav_config
    reference = Qwen3OmniMoeCode2Wav._from_config(config, dtype=torch.bfloat16).eval()
    weights = {k[len("code2wav."):]: v for k, v in load_file(str(Path(run["model"]) / "model.safetensors")).items()
               if k.startswith("code2wav.")}
    reference.load_state_dict(weights, strict=True)
    codes = torch.tensor(direct["codes"]).reshape(1, config.num_quantizers, direct["frames"])
    with torch.no_grad():
        ref = reference(codes).reshape(-1).float()
    wave = torch.tensor(direct["waveform"])
    assert wave.numel() == ref.numel() > direct["frames"]
    assert float(wave.std()) > 1e-2, "a silent waveform proves nothing"
    # Both bf16 on the same weights and codes; the engine's decoder may order reductions otherwise.
    assert float((wave - ref).abs().max()) <= 0.05 * float(ref.abs().max())


def test_thinker_runs_and_hands_over_to_the_talker_prefill(run):
    parity = run["results"]["shim"]["parity"]
    reached = {rid: p for rid, p in parity.items() if p["stage"] != "thinker"}
    assert reached and set(reached) == set(parity), parity  # one batch: all hand over before the talker decodes
    for p in reached.values():
        assert len(p["thinker_tokens"]) == 12
        # vllm-omni's own length for the talker's prompt (user turn + 9 assistant rows) was computed.
        assert p["talker_prompt_len"] > 9
    assert len({t for p in reached.values() for t in p["thinker_tokens"]}) > 2, "degenerate tokens prove little"


def test_the_talker_prefill_returns_its_sampled_token_and_the_runner_up_with_logprobs(run):
    """The parity report reads, where the two pipelines' talker tokens differ, each one's top-2 margin:
    the shim's talker (V2's sampler) returns them; on CPU for its prefill step's token."""
    parity = run["results"]["shim"]["parity"]
    talked = {rid: p for rid, p in parity.items() if p["talker_tokens"]}
    assert talked, parity
    for p in talked.values():
        assert len(p["talker_logprobs"]) == len(p["talker_tokens"]) >= 1
        for token, top in zip(p["talker_tokens"], p["talker_logprobs"]):
            (t1, l1), (t2, l2) = top
            assert t1 == token and t2 != token  # greedy: the sampled token is the best one
            assert 0.0 >= l1 >= l2 > -1e6  # the talker's suppressed tokens (-1e9 logits) are never the runner-up


def test_the_thinker_serves_text_and_image_requests(run):
    """Where the checkpoint has its processor files (its builder had torchvision: transformers' Qwen2-VL
    video processor, which Qwen3OmniMoeProcessor loads for an image request too, is torchvision-only),
    vllm-omni's thinker takes the generated image through vLLM's multimodal processor (its placeholder
    expanded to the image's 2 tokens), its vision tower and M-RoPE, runs every token, and hands over to
    the talker's prefill."""
    image_requests = run["summary"]["requests"]["text_and_image"]
    if not isinstance(image_requests, dict):
        pytest.skip(image_requests)
    from tests.tiny_models.qwen3_omni import VISION, image_chat_prompt

    spec = image_requests["image"]
    tokens = spec["width"] * spec["height"] // (VISION["patch_size"] * VISION["spatial_merge_size"]) ** 2
    assert tokens == 2
    parity = run["results"]["shim"]["parity"]
    for req in image_requests["requests"]:
        p = parity[req["rid"]]
        assert p["stage"] == "talker", p
        assert p["thinker_prompt_len"] == len(image_chat_prompt([0] * req["text_len"])) - 1 + tokens
        assert len(p["thinker_tokens"]) == 12 and p["talker_prompt_len"] > 9
        assert len(p["talker_logprobs"]) == len(p["talker_tokens"]) == 1


def test_every_request_is_spoken_and_its_audio_is_transformers_decoder_on_its_codes(run):
    """The talker's decode steps too (vllm-omni's code predictor on the shim's CPU platform for it): every
    request runs thinker -> talker -> code2wav, and its waveform is transformers' `Qwen3OmniMoeCode2Wav` on
    the codes vllm-omni's talker -> code2wav hand-over took from the talker."""
    from safetensors.torch import load_file
    from transformers import AutoConfig
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeCode2Wav

    shim = run["results"]["shim"]
    assert "error" not in shim, shim.get("error")
    parity = shim["parity"]
    assert parity and {p["stage"] for p in parity.values()} == {"done"}, {r: p["stage"] for r, p in parity.items()}
    config = AutoConfig.from_pretrained(run["model"]).code2wav_config
    reference = Qwen3OmniMoeCode2Wav._from_config(config, dtype=torch.bfloat16).eval()
    reference.load_state_dict({k[len("code2wav."):]: v for k, v in load_file(str(Path(run["model"]) / "model.safetensors")).items()
                               if k.startswith("code2wav.")}, strict=True)
    kept = {rid: p for rid, p in parity.items() if p["waveform"] is not None}
    assert kept, "no waveform kept"
    for rid, p in kept.items():
        codes = torch.tensor(p["codes"])
        assert codes.numel() and codes.numel() % config.num_quantizers == 0, rid
        frames = codes.numel() // config.num_quantizers
        assert len(p["talker_tokens"]) >= frames, rid  # a frame per talker token (its EOS none)
        with torch.no_grad():
            ref = reference(codes.reshape(1, config.num_quantizers, frames)).reshape(-1).float()
        wave = torch.tensor(p["waveform"])
        assert wave.numel() == ref.numel(), rid
        assert float(ref.std()) > 1e-2, "a silent waveform proves nothing"
        # Both bf16 on the same weights and codes; the engine's decoder may order reductions otherwise.
        assert float((wave - ref).abs().max()) <= 0.05 * float(ref.abs().max()), rid
