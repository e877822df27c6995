"""vllm-omni's own Qwen3-TTS classes on real vLLM V2 + the shim, loaded without vllm-omni's patches.

vllm-omni (the pinned wheel, deploy/cpu/install.sh) is put on the engines' sys.path as an install
in site-packages would be, its `vllm.general_plugins` entry point included. With
`VLLM_PLUGINS=omni_sidecar_shim` (the documented setting) the shim's plugin loads its classes with
the package stood in: no patch in any engine process, the published config layout parsed by
upstream (M-RoPE section), the talker's M-RoPE positions, and the code2wav stage end to end through
the shim and `omni-code2wav`, its waveform equal to vllm-omni's own forward on the same codes.
With vllm-omni's entry point let in, its patch.py runs and the shim refuses to start, naming it.

vllm-omni has no CPU platform (its code predictor, `talker_mtp`, asks its platform whether torch
inductor is there, and its unspecified platform raises); the shim gives it one through vllm-omni's own
`vllm_omni.platform_plugins` group (worker_shim/omni_models/cpu_platform.py), so the talker's decode
steps run here too.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.support.procs import ROOT, SidecarProcess, run_engine
from tests.support.vllm_omni_payload import installed_vllm_omni

pytestmark = pytest.mark.e2e
JOB = ROOT / "tests" / "support" / "vllm_omni_job.py"
SHIM_ONLY = {"VLLM_PLUGINS": "omni_sidecar_shim"}
LLM_KWARGS = {"max_model_len": 128, "max_num_batched_tokens": 128, "max_num_seqs": 4}
CHUNK, LEFT = 4, 8  # omni-code2wav's options; LEFT covers the tiny decoder's receptive field
CODE2WAV_REQUESTS = [
    {"frames": 9, "seed": 1, "chunk_frames": CHUNK, "left_context": LEFT},
    {"frames": 5, "seed": 2, "chunk_frames": CHUNK, "left_context": LEFT},
    {"frames": 7, "seed": 3, "chunk_frames": 3, "left_context": 4, "in_payload": True},
]
TALKER_REQUESTS = [{"seed": 1, "text_len": 4, "max_tokens": 3}, {"seed": 2, "text_len": 6, "max_tokens": 5}]
ATOL = 1e-6  # float32 on CPU, batched against one request at a time (waveform std ~1e-2)


def sys_path() -> list[str]:
    return [str(installed_vllm_omni()), str(ROOT / "tests" / "support" / "torchaudio_stub")]


@pytest.fixture(scope="module")
def qwen3_tts_dir(tmp_path_factory):
    work = tmp_path_factory.mktemp("qwen3-tts")
    res = run_engine({"build_into": str(work / "model"), "env": SHIM_ONLY, "sys_path": sys_path()}, work, "build",
                     script=JOB, timeout_s=300)
    assert res["ok"], res.get("traceback")
    assert res["patches_front_end"] == []
    return res["model"]


def engine(model: str, work, name: str, hooks: str | None, arch: str, env: dict, options=(), **job) -> dict:
    """One engine job; with a sidecar serving `hooks` (None: none, the engine must stop before it connects)."""
    endpoint = f"ipc://{work}/{name}.sock"
    sidecar = SidecarProcess(endpoint, hooks, work / f"{name}-sidecar.log", options=list(options)) if hooks else None
    try:
        return run_engine({"model": model, "endpoint": endpoint, "arch": arch, "env": env, "sys_path": sys_path(),
                           "llm_kwargs": LLM_KWARGS, **job}, work, name, script=JOB, timeout_s=300)
    finally:
        if sidecar is not None:
            sidecar.stop()


def test_published_layout(qwen3_tts_dir):
    """The files and config sections of the published Qwen3-TTS checkpoints."""
    from pathlib import Path

    model = Path(qwen3_tts_dir)
    for name in ("config.json", "generation_config.json", "vocab.json", "merges.txt", "tokenizer_config.json",
                 "preprocessor_config.json", "model.safetensors", "speech_tokenizer/config.json",
                 "speech_tokenizer/configuration.json", "speech_tokenizer/preprocessor_config.json",
                 "speech_tokenizer/model.safetensors"):
        assert (model / name).is_file(), name
    config = json.loads((model / "config.json").read_text())
    assert config["model_type"] == "qwen3_tts"
    talker = config["talker_config"]
    assert talker["rope_scaling"]["mrope_section"] == [12, 10, 10]
    assert sum(talker["rope_scaling"]["mrope_section"]) == talker["head_dim"] // 2
    assert talker["code_predictor_config"]["rope_scaling"] is None
    assert {"mel_dim", "enc_dim", "sample_rate"} <= set(config["speaker_encoder_config"])
    speech = json.loads((model / "speech_tokenizer" / "config.json").read_text())
    assert speech["model_type"] == "qwen3_tts_tokenizer_12hz"
    assert speech["decoder_config"]["codebook_dim"] > 0 and "encoder_config" in speech
    from safetensors import safe_open
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(qwen3_tts_dir)  # as vllm-omni's prompt builder loads it
    assert len(tokenizer) == 256 and len(tokenizer("any text, no merges")["input_ids"]) == 19
    with safe_open(str(model / "model.safetensors"), "pt") as f:
        assert {k.split(".")[0] for k in f.keys()} == {"talker", "speaker_encoder"}
    with safe_open(str(model / "speech_tokenizer" / "model.safetensors"), "pt") as f:
        assert {k.split(".")[0] for k in f.keys()} == {"encoder", "decoder"}


def test_talker_loads_without_patches_in_a_spawned_engine(qwen3_tts_dir, tmp_path):
    """The talker in an engine core and a worker spawned from the front-end (the VllmConfig pickled
    across): no patch in any of the three processes, upstream's M-RoPE config, the shim's positions; then the first request
    runs: prefill, then decode steps with vllm-omni's code predictor."""
    # OMNI_SIDECAR=1: the shim selected by the environment, so its plugin checks every process.
    env = {**SHIM_ONLY, "VLLM_ENABLE_V1_MULTIPROCESSING": "1", "VLLM_WORKER_MULTIPROC_METHOD": "spawn",
           "OMNI_SIDECAR": "1"}
    res = engine(qwen3_tts_dir, tmp_path, "talker", "omni-talker", "Qwen3TTSTalkerForConditionalGeneration", env,
                 mrope_tokens=6, talker_requests=TALKER_REQUESTS)
    assert res["ok"], res.get("traceback")
    assert res["patches_front_end"] == [] and res["patches_workers"] == [[]]
    assert res["hf_config_class"] == "worker_shim.omni_models.qwen3_tts.config.Qwen3TTSConfig"
    assert res["uses_mrope"] and res["mrope_section"] == [12, 10, 10]
    assert res["model_class"] == ["worker_shim.omni_models.qwen3_tts.talker.Qwen3TTSTalkerForConditionalGeneration",
                       "vllm_omni.model_executor.models.qwen3_tts.qwen3_tts_talker."
                       "Qwen3TTSTalkerForConditionalGeneration"]
    assert res["vllm_omni_modules"]["stand_in"] and res["vllm_omni_modules"]["loaded"] > 10
    mrope = res["mrope_positions"]
    assert mrope["supports_mrope"] and mrope["delta"] == 0
    assert mrope["positions"] == [list(range(6))] * 3
    log = open(res["log_path"]).read()
    # The plugin's check passed in the two spawned processes (the front-end's is patches_front_end).
    checked = {line.split(" pid=")[0] for line in log.splitlines() if "no vllm-omni patch in this process" in line}
    assert any("EngineCore" in p for p in checked) and any("Worker" in p for p in checked), checked
    # The limit on CPU, exactly: the decode step's talker_mtp (after the prefill step ran).
    # Decode steps too, on the shim's CPU platform for vllm-omni (its code predictor eager): the sidecar
    # assembled each request's frames, a frame per token but the last (whose residual codes its
    # next step, never run, would predict), each the talker's code groups inside its codec.
    assert "talker_error" not in res, res.get("talker_traceback")
    assert "vllm-omni runs on the shim's CPU platform" in log
    config = json.loads((Path(qwen3_tts_dir) / "config.json").read_text())["talker_config"]
    for spec, codes in zip(TALKER_REQUESTS, res["talker_codes"], strict=True):
        assert codes is not None and len(codes) == spec["max_tokens"] - 1
        assert all(len(frame) == config["num_code_groups"] for frame in codes)
        assert all(0 <= c < config["codec_pad_id"] for frame in codes for c in frame), codes


def test_vllm_omni_entry_point_let_in_is_reported(qwen3_tts_dir, tmp_path):
    """Without VLLM_PLUGINS, vLLM loads vllm-omni's entry point, which imports its package and patch.py;
    the shim's worker refuses to start and names what was replaced and the setting that avoids it."""
    res = engine(qwen3_tts_dir, tmp_path, "patched", None, "Qwen3TTSTalkerForConditionalGeneration",
                 {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}, env_unset=["VLLM_PLUGINS"], load_plugins=True,
                 mrope_tokens=1)
    assert not res["ok"]
    found = res["patches_after_plugins"]
    assert "vllm_omni.patch imported" in found
    assert "vllm.v1.request.RequestStatus.WAITING_FOR_CHUNK" in found
    assert "vllm.v1.request.Request" in found and "vllm.v1.engine.EngineCoreRequest" in found
    assert res["error"].startswith("ShimCompatError: omni-sidecar's shim runs on unmodified vLLM")
    assert "vllm_omni.patch imported" in res["error"] and "VLLM_PLUGINS=omni_sidecar_shim" in res["error"]
    assert "\n" not in res["error"]


def test_vllm_omni_code2wav_through_the_shim_equals_its_own_forward(qwen3_tts_dir, tmp_path):
    """vllm-omni's code2wav as the generation-only stage (omni-code2wav feeds each step's chunk): each
    request's waveform equals vllm-omni's own `Qwen3TTSCode2Wav.forward` on the same chunks, and, the
    left context covering the decoder's receptive field, one forward on the whole codes."""
    res = engine(qwen3_tts_dir, tmp_path, "code2wav", "omni-code2wav", "Qwen3TTSCode2Wav",
                 {**SHIM_ONLY, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"},
                 options=[f"chunk_frames={CHUNK}", f"left_context={LEFT}"], requests=CODE2WAV_REQUESTS)
    assert res["ok"], res.get("traceback")
    assert res["patches_front_end"] == [] and res["patches_workers"] == [[]]
    assert not res["uses_mrope"]  # vllm-omni's config drops the section for this architecture
    assert res["model_class"][0] == "worker_shim.omni_models.qwen3_tts.code2wav.Qwen3TTSCode2Wav"
    (direct,) = res["direct"]
    worst = 0.0
    for i, (spec, got, ref) in enumerate(zip(CODE2WAV_REQUESTS, res["waveforms"], direct)):
        wave = torch.tensor(got["waveform"])
        chunks = torch.tensor([x for chunk in ref["chunks"] for x in chunk])
        assert wave.shape == chunks.shape == (spec["frames"] * 8,), f"request {i}"  # 8 samples a frame
        assert float(wave.std()) > 1e-3, "a silent waveform proves nothing"
        worst = max(worst, float((wave - chunks).abs().max()))
        torch.testing.assert_close(wave, chunks, atol=ATOL, rtol=0, msg=f"request {i}")
        if spec["left_context"] >= LEFT:
            torch.testing.assert_close(wave, torch.tensor(ref["whole"]), atol=ATOL, rtol=0, msg=f"request {i}")
        assert got["sr"] == 24000
    print(f"vllm-omni code2wav: max |V2 + shim + omni-code2wav - its own forward| = {worst:.3g}")
    (shim,) = res["shim_stats"]
    assert shim["request_errors"] == {} and shim["blocking_exchanges"] == shim["steps"]
