#!/bin/sh
# Qwen3-Omni parity on one GPU in one go (docs/ARCHITECTURE.md, "GPU bundle"):
#   deploy/gpu/run_qwen3_omni.sh BUNDLE_DIR OUT_DIR [LIMIT_S]
# installs the bundle into /tmp/omni-site (once per machine; built with BUNDLE_OMNI=1 and
# BUNDLE_KEEP_MOE=1: Qwen3-Omni's thinker and talker are MoE models, whose CUDA path needs vLLM's
# _moe_C), builds the tiny Qwen3-Omni checkpoint of the published layout
# (tests/tiny_models/qwen3_omni.py), then runs deploy/gpu/qwen3_omni_parity.py: vllm-omni 0.26's own
# three stages (V1 runner) and ours (three V2 engines + shim + a sidecar each), the same requests,
# side by side. LIMIT_S (default 470) bounds the whole run, install included; each pipeline stops
# cleanly by then and reports what it has. Leaves in OUT_DIR: qwen3-omni-parity.json
# (docs/bench/gpu/), qwen3-omni.log (the table), the pipelines' and sidecars' log tails.
# Recipe (the bundle 58.3 MiB, with the 2.4 MB tree within the 64 MiB a device call carries):
#   here:  BUNDLE_SM=90 BUNDLE_NO_JIT_HEADERS=1 BUNDLE_OMNI=1 BUNDLE_KEEP_MOE=1 BUNDLE_PACK_WHEELS=1 \
#            deploy/gpu/build_bundle.sh .gpu-bundle-moe         (an ignored folder; no BUNDLE_PROFILER)
#   there: carry [".gpu-bundle-moe"], timeout_s 560,
#            sh deploy/gpu/run_qwen3_omni.sh .gpu-bundle-moe $OUT 500
set -u
B=$1 OUT=$2 LIMIT=${3:-470}
SRC=$(cd "$(dirname "$0")/../.." && pwd)
SITE=/tmp/omni-site
mkdir -p "$OUT"
t0=$(date +%s)
sh "$SRC/deploy/gpu/install_once.sh" "$B" "$OUT" || exit 1
echo "installed in $(( $(date +%s) - t0 )) s"
if ! ls "$SITE"/vllm/_moe_C*.so > /dev/null 2>&1; then
  # vLLM's CUDA MoE path calls torch.ops._moe_C (topk_softmax, moe_align_block_size): no engine would run.
  why="the bundle has no vllm/_moe_C (build it with BUNDLE_KEEP_MOE=1): the MoE thinker and talker cannot run"
  echo "$why"
  printf '{"error": "%s", "command": "sh deploy/gpu/run_qwen3_omni.sh BUNDLE OUT [LIMIT_S]"}\n' "$why" \
    > "$OUT/qwen3-omni-parity.json"
  exit 1
fi
cd "$SRC"  # `python -m` children put the working directory first on sys.path
export PYTHONPATH="$SRC:$SITE" VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 \
  PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
W=$(mktemp -d /tmp/qwen3-omni-XXXXXX)  # private: the sidecars' sockets live there
python3 -m tests.tiny_models.qwen3_omni "$W/model" > "$OUT/model.log" 2>&1 || { tail -30 "$OUT/model.log"; exit 1; }
left=$(( LIMIT - ($(date +%s) - t0) - 15 ))
timeout "$left" python3 "$SRC/deploy/gpu/qwen3_omni_parity.py" --model "$W/model" --out "$W/work" \
  --result "$OUT/qwen3-omni-parity.json" --limit-s $(( left - 10 )) > "$OUT/qwen3-omni.log" 2>&1
echo "qwen3_omni_parity.py rc=$? after $(( $(date +%s) - t0 )) s"
grep -v '^\[W\|^INFO\|^WARNING\|^DEBUG' "$OUT/qwen3-omni.log" | tail -30
for f in "$W"/work/*.log; do echo "=== $(basename "$f")"; grep -E "patch|Error|error|Traceback" "$f" | tail -20; tail -25 "$f"; done \
  > "$OUT/engine-logs.txt" 2>/dev/null
cp "$W/work/qwen3-omni-report.json" "$OUT/" 2>/dev/null
rm -f "$OUT/install.log" "$OUT/model.log"
exit 0
