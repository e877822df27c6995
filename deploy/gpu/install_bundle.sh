#!/bin/sh
# Offline install of a bundle made by build_bundle.sh:
#   deploy/gpu/install_bundle.sh BUNDLE_DIR TARGET_DIR && export PYTHONPATH=TARGET_DIR
set -eu
B=$1
TARGET=${2:-/opt/omni-site}
PY=${PY:-python3}
(cd "$B" && sha256sum -c --quiet SHA256SUMS)
mkdir -p "$TARGET"
cat "$B"/vllm-tree.part-* | tar -C "$TARGET" -xJf -
$PY -m pip install -q --no-index --no-deps --no-compile --target "$TARGET" "$B"/wheels/*.whl
echo "installed into $TARGET; export PYTHONPATH=$TARGET VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1"
