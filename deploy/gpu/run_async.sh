#!/bin/sh
# The async-scheduling check in one go on a bare GPU host (docs/ARCHITECTURE.md, "Async scheduling"):
#   [ASYNC_LIMIT_S=420] sh deploy/gpu/run_async.sh BUNDLE_DIR OUT_DIR [async_scheduling.py options...]
# installs the bundle (built with BUNDLE_SM=90 BUNDLE_NO_JIT_HEADERS=1 BUNDLE_OMNI=1) into
# /tmp/omni-site, builds the tiny Qwen3-TTS checkpoint (tests/tiny_models/qwen3_tts.py), runs
# deploy/gpu/async_scheduling.py (every hook set with async scheduling on and off, side by side on
# GPU 0) and leaves in OUT_DIR: async-scheduling.json, async.log (the table) and the engines' logs.
set -u
B=$1 OUT=$2 LIMIT=${ASYNC_LIMIT_S:-420}  # the whole run, install included; rounds past it are cut
shift 2
. "$(dirname "$0")/bundle_setup.sh"  # SRC, SITE, t0; the bundle installed; in $SRC
export PYTHONPATH="$SRC:$SITE" VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 \
  PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
W=$(mktemp -d /tmp/async-XXXXXX)
VLLM_PLUGINS=omni_sidecar_shim python3 -m tests.tiny_models.qwen3_tts "$W/tts" > "$OUT/model.log" 2>&1 \
  || { tail -30 "$OUT/model.log"; exit 1; }
left=$(( LIMIT - ($(date +%s) - t0) - 15 ))
timeout "$left" python3 "$SRC/deploy/gpu/async_scheduling.py" --tts-model "$W/tts" --out "$OUT" \
  --limit-s $(( left - 20 )) "$@" > "$OUT/async.log" 2>&1
echo "async_scheduling.py rc=$? after $(( $(date +%s) - t0 )) s"
grep -v '^\[W' "$OUT/async.log" | tail -40
rm -f "$OUT/install.log" "$OUT/model.log"
exit 0
