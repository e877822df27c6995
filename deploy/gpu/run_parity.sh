#!/bin/sh
# The GPU talker check in one go on a bare GPU host (docs/ARCHITECTURE.md, "GPU bundle"):
#   deploy/gpu/run_talker.sh BUNDLE_DIR MODEL_DIR OUT_DIR [SECONDS]
# installs the bundle (built with BUNDLE_SM=90 BUNDLE_NO_JIT_HEADERS=1 BUNDLE_OMNI=1) into /tmp/omni-site,
# runs deploy/gpu/talker.py on MODEL_DIR (made by deploy/gpu/tiny_qwen3_tts.py) and copies its
# result, the engines' and the sidecar's logs to OUT_DIR.
set -u
B=$1
MODEL=$2
OUT=$3
LIMIT=${4:-540}
SRC=$(cd "$(dirname "$0")/../.." && pwd)
SITE=/tmp/omni-site
mkdir -p "$OUT"
t0=$(date +%s)
if ! sh "$SRC/deploy/gpu/install_bundle.sh" "$B" "$SITE" > "$OUT/install.log" 2>&1; then
  tail -40 "$OUT/install.log"
  exit 1
fi
echo "installed in $(( $(date +%s) - t0 )) s"
cd "$SRC"  # `python -m` children put the working directory first on sys.path
export PYTHONPATH="$SRC:$SITE" VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 \
  PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
W=$(mktemp -d /tmp/talker-XXXXXX)  # private: the sidecar's socket lives there
timeout "$LIMIT" python3 "$SRC/deploy/gpu/talker.py" --model "$MODEL" --out "$W" > "$OUT/talker.log" 2>&1
echo "talker.py rc=$? after $(( $(date +%s) - t0 )) s"
tail -30 "$OUT/talker.log"
for f in talker.json omni.log shim.log talker-sidecar.log; do
  [ -f "$W/$f" ] && cp "$W/$f" "$OUT/$f"
done
exit 0
