#!/bin/sh
# The M-RoPE and three-stage pipeline GPU checks in one go on a bare GPU host (docs/ARCHITECTURE.md, "GPU bundle"):
#   deploy/gpu/run_omni.sh BUNDLE_DIR OUT_DIR [SECONDS]
# installs the bundle into /tmp/omni-site (once per machine), then runs
#   1. deploy/gpu/mrope.py: the tiny Qwen2-VL (M-RoPE, images) shim vs plain V2, CUDA graphs on;
#   2. examples/demo.py --cuda --by-hand: the three-stage streaming pipeline (thinker and talker
#      with CUDA graphs), its time to first audio, and its audio against the stages by hand.
# The tiny models come prebuilt under .cache/ (make demo builds them). Results and logs to OUT_DIR.
set -u
B=$1
OUT=$2
LIMIT=${3:-180}
SRC=$(cd "$(dirname "$0")/../.." && pwd)
SITE=/tmp/omni-site
mkdir -p "$OUT"
t0=$(date +%s)
sh "$SRC/deploy/gpu/install_once.sh" "$B" "$OUT" || exit 1
# Wheels a bundle built before it listed them (blake3: vLLM hashes multimodal inputs with it).
[ -d "$SRC/.whl" ] && python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "$SRC"/.whl/*.whl
echo "installed in $(( $(date +%s) - t0 )) s"
cd "$SRC"
export PYTHONPATH="$SRC:$SITE" VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 \
  PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false VLLM_USE_V2_MODEL_RUNNER=1
W=$(mktemp -d /tmp/omni-XXXXXX)  # private: the sidecars' sockets live there
timeout "$LIMIT" python3 deploy/gpu/mrope.py --model "$SRC/.cache/tiny-vl-thinker" --out "$W/mrope" > "$OUT/mrope.log" 2>&1
echo "mrope.py rc=$? after $(( $(date +%s) - t0 )) s"
grep -E "^\[(PASS|FAIL)\]" "$OUT/mrope.log"
timeout "$LIMIT" python3 examples/demo.py --cuda --requests 3 --by-hand --out "$W/demo" > "$OUT/demo.log" 2>&1
echo "demo.py rc=$? after $(( $(date +%s) - t0 )) s"
grep -v '^\s*$' "$OUT/demo.log" | tail -14
mkdir -p "$OUT/mrope" "$OUT/demo"
cp "$W"/mrope/*.json "$W"/mrope/*.log "$OUT/mrope/" 2>/dev/null
cp "$W"/demo/*.json "$W"/demo/*.log "$W"/demo/*.wav "$OUT/demo/" 2>/dev/null
grep -c "Capturing CUDA graphs (FULL" "$W"/demo/*.stream.log 2>/dev/null
exit 0
