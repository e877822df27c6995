"""Qwen3-Omni on upstream vLLM + the shim: the published layout, vllm-omni's classes, no patch.

A tiny random checkpoint in the published Qwen3-Omni-30B-A3B layout (tests/tiny_models/qwen3_omni.py)
and vllm-omni (the pinned wheel, off sys.path, as tests/test_vllm_omni_models.py puts it there),
in one job (tests/support/qwen3_omni_job.py):
- upstream parses the layout: transformers' config classes (model_type "qwen3_omni_moe" is
  transformers' own, nothing registered), the thinker's interleaved M-RoPE section, upstream's own
  thinker for the published architecture name; the weight names and the tokenizer's special ids
  are the published ones;
- the shim's loader registers vllm-omni's Qwen3-Omni classes (one name per stage of its outer
  class, and its inner thinker / talker / code2wav names) pointing at the shim's modules;
- vllm-omni's code2wav class, built and loaded as its outer class does, gives transformers'
  `Qwen3OmniMoeCode2Wav`'s waveform on the same codes;
- upstream's thinker (MoE, M-RoPE) in a real V2 engine with the shim gives transformers' own
  thinker's greedy tokens;
- no vllm-omni patch in the front-end or the worker.

What does not run here, exactly: vllm-omni's thinker, talker and outer (stage) classes do not import
against this venv's vLLM 0.32: its thinker module imports vllm-omni's Qwen2.5-Omni thinker, which
imports `MultiModalProcessingInfo` from vLLM's `multimodal.processing.processor`, which vLLM 0.32 no
longer has (vLLM 0.26 does; vllm-omni 0.26 and 0.30 both import it). The H200 pair (vLLM 0.26 +
vllm-omni 0.26) has it; the test asserts the exact error so that a matching vLLM here fails it
(extend the test then).
"""

from __future__ import annotations

import pytest
import torch

from tests.support.procs import ROOT, SidecarProcess, run_engine
from tests.support.vllm_omni_payload import installed_vllm_omni
from tests.tiny_models.qwen3_omni import MROPE_SECTION, TALKER

pytestmark = pytest.mark.e2e
JOB = ROOT / "tests" / "support" / "qwen3_omni_job.py"
PROMPTS = [[872, 1, 2, 3, 4, 5, 6], [100, 200, 300]]
MAX_TOKENS = 6
CODES = {"frames": 12, "seed": 3}
# The outer class per stage and vllm-omni's inner names (its models/registry.py), to the shim's modules.
REGISTERED = {
    "Qwen3OmniMoeThinkerStage": "worker_shim.omni_models.qwen3_omni.stages:Qwen3OmniMoeThinkerStage",
    "Qwen3OmniMoeTalkerStage": "worker_shim.omni_models.qwen3_omni.stages:Qwen3OmniMoeTalkerStage",
    "Qwen3OmniMoeCode2WavStage": "worker_shim.omni_models.qwen3_omni.stages:Qwen3OmniMoeCode2WavStage",
    "Qwen3OmniMoeThinkerForConditionalGeneration":
        "worker_shim.omni_models.qwen3_omni.thinker:Qwen3OmniMoeThinkerForConditionalGeneration",
    "Qwen3OmniMoeTalkerForConditionalGeneration":
        "worker_shim.omni_models.qwen3_omni.talker:Qwen3OmniMoeTalkerForConditionalGeneration",
    "Qwen3OmniMoeCode2Wav": "worker_shim.omni_models.qwen3_omni.code2wav:Qwen3OmniMoeCode2Wav",
}
SKEW = ("ImportError: cannot import name 'MultiModalProcessingInfo' from "
        "'vllm.multimodal.processing.processor'")


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    work = tmp_path_factory.mktemp("qwen3-omni")
    endpoint = f"ipc://{work}/thinker.sock"
    sidecar = SidecarProcess(endpoint, "passthrough", work / "sidecar.log")
    sys_path = [str(installed_vllm_omni()), str(ROOT / "tests" / "support" / "torchaudio_stub"),
                str(ROOT / "tests" / "support" / "no_torchvision")]
    try:
        res = run_engine({"build_into": str(work / "model"), "endpoint": endpoint, "sys_path": sys_path,
                          "env": {"VLLM_PLUGINS": "omni_sidecar_shim", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"},
                          "prompts": PROMPTS, "max_tokens": MAX_TOKENS, "codes": CODES}, work, "qwen3-omni",
                         script=JOB, timeout_s=300)
    finally:
        sidecar.stop()
    assert res["ok"], res.get("traceback")
    return res


def test_upstream_parses_the_published_layout(job):
    keys = set(job["checkpoint_keys"])
    assert {k.split(".")[0] for k in keys} == {"thinker", "talker", "code2wav"}
    assert {k.split(".")[1] for k in keys if k.startswith("thinker.")} == {"audio_tower", "visual", "model", "lm_head"}
    # Experts one by one, as published (vLLM's loaders map these names), and the talker's shared expert.
    assert "thinker.model.layers.0.mlp.experts.3.gate_proj.weight" in keys
    assert "talker.model.layers.1.mlp.shared_expert.down_proj.weight" in keys
    assert "talker.code_predictor.lm_head.14.weight" in keys  # one head per residual codebook (16 - 1)
    assert job["hf_config_class"] == "Qwen3OmniMoeConfig" and job["hf_text_config_class"] == "Qwen3OmniMoeTextConfig"
    assert job["sections"] == ["code2wav_config", "talker_config", "thinker_config"]
    assert job["uses_mrope"] and job["rope_parameters"]["mrope_section"] == MROPE_SECTION
    assert job["rope_parameters"]["mrope_interleaved"] is True
    assert job["upstream_class"] == ("vllm.model_executor.models.qwen3_omni_moe_thinker."
                                     "Qwen3OmniMoeThinkerForConditionalGeneration")


def test_tokenizer_has_the_published_special_ids(job):
    tok = job["tokenizer"]
    assert tok["size"] == 151676  # 151643 entries, then the 33 added tokens
    assert tok["tokens"] == {
        "thinker_config.audio_start_token_id": "<|audio_start|>", "thinker_config.audio_end_token_id": "<|audio_end|>",
        "thinker_config.audio_token_id": "<|audio_pad|>", "thinker_config.image_token_id": "<|image_pad|>",
        "thinker_config.video_token_id": "<|video_pad|>", "thinker_config.vision_start_token_id": "<|vision_start|>",
        "thinker_config.vision_end_token_id": "<|vision_end|>", "im_start_token_id": "<|im_start|>",
        "im_end_token_id": "<|im_end|>", "tts_pad_token_id": "<tts_pad>", "tts_bos_token_id": "<tts_text_bos>",
        "tts_eos_token_id": "<tts_text_eod>"}
    assert len(tok["text_ids"]) == len("hi there") and max(tok["text_ids"]) < 256  # bytes, no merges
    assert tok["chat"] == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    # Named as published, at the config's ids: what Qwen3OmniMoeProcessor reads for an image or audio.
    assert tok["multimodal_tokens"] == {
        "image_token": ["<|image_pad|>", 151655], "video_token": ["<|video_pad|>", 151656],
        "audio_token": ["<|audio_pad|>", 151675], "vision_bos_token": ["<|vision_start|>", 151652],
        "vision_eos_token": ["<|vision_end|>", 151653], "audio_bos_token": ["<|audio_start|>", 151669],
        "audio_eos_token": ["<|audio_end|>", 151670]}


def test_processor_files_only_where_torchvision_is(job):
    """Qwen3OmniMoeProcessor loads Qwen2-VL's video processor for any multimodal request, and
    transformers has that one on torchvision only: without it (this venv) the builder leaves the
    processor out and says so, and the H200 driver reports its text + image requests as not run."""
    import importlib.util

    tok = job["tokenizer"]
    has_torchvision = importlib.util.find_spec("torchvision") is not None
    assert tok["stamp"]["processor"] is has_torchvision
    assert tok["processor_files"] == (["processor_config.json"] if has_torchvision else [])


def test_talker_stage_config_through_hf_overrides(job):
    """Upstream sizes the talker stage from talker_config's text model (vllm-omni: hf_config_name
    "talker_config"), not the thinker's, given `hf_overrides=talker_stage_config`."""
    text = TALKER["text_config"]
    assert job["talker_stage"] == {
        "architectures": ["Qwen3OmniMoeTalkerStage"], "text_config_class": "Qwen3OmniMoeTalkerTextConfig",
        "mrope_section": MROPE_SECTION, "vocab_size": text["vocab_size"], "hidden_size": text["hidden_size"],
        "layers": text["num_hidden_layers"], "num_experts": text["num_experts"]}


def test_loader_registers_vllm_omni_qwen3_omni_classes(job):
    assert job["registry"] == REGISTERED
    assert set(REGISTERED) <= set(job["registered"])


def test_no_vllm_omni_patch_anywhere(job):
    assert job["patches_before_engine"] == [] and job["patches_front_end"] == []
    assert job["patches_workers"] == [[]]


def test_vllm_omni_stage_classes_need_the_vllm_they_were_built_for(job):
    """Beside the vLLM its vllm-omni was built for (0.26 with 0.26) every stage module imports; on
    any other (CI's vLLM 0.32) the exact limit: vllm-omni's thinker module chain does not import,
    its code2wav module does (the other test runs it)."""
    from tests.support.paired_vllm_omni import PAIRED, vllm_version

    errors = job["import_errors"]
    if vllm_version() == PAIRED:
        assert errors == {}, errors
        return
    assert set(errors) == {"thinker", "talker", "stages"}, errors
    assert all(e.startswith(SKEW) for e in errors.values()), errors


def test_vllm_omni_code2wav_equals_transformers(job):
    c2w = job["code2wav"]
    assert c2w["loaded"] == c2w["checkpoint"] > 0  # every code2wav.* tensor of the checkpoint, by its own loader
    wave, ref = torch.tensor(c2w["waveform"]), torch.tensor(c2w["reference"])
    assert wave.numel() > CODES["frames"] * c2w["total_upsample"] // 2
    assert float(wave.std()) > 1e-2, "a silent waveform proves nothing"
    assert float((wave.abs() >= 1).float().mean()) < 0.05, "clamped samples compare equal whatever came before"
    torch.testing.assert_close(wave, ref, atol=1e-6, rtol=0)


def test_upstream_thinker_on_v2_with_the_shim_equals_transformers(job):
    """Upstream's Qwen3-Omni thinker (MoE, interleaved M-RoPE) through V2 and the shim, greedy,
    against transformers' own thinker on the same checkpoint."""
    assert job["engine_tokens"] == job["reference_tokens"]
    assert all(len(t) == MAX_TOKENS for t in job["engine_tokens"])
    assert len({t for seq in job["engine_tokens"] for t in seq}) > 2, "degenerate tokens prove little"
