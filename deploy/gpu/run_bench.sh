#!/bin/sh
# The one-GPU throughput bench in one go on a bare GPU host:
#   deploy/gpu/run_bench.sh BUNDLE_DIR OUT_DIR [SECONDS] [bench.gpu options...]
# installs the bundle (deploy/gpu/build_bundle.sh) into /tmp/omni-site, runs
# `python3 -m bench.gpu` with a budget of what is left of SECONDS (default 470) after the
# install, less a margin for the copies, and leaves in OUT_DIR: gpu_ab.json (every round,
# machine, versions, spread), BENCHMARKS.md (the rendered report), bench.log, py-spy stacks,
# the sidecars' logs. Partial results are written after every block, so a run cut short
# still leaves its figures.
set -u
B=$1
OUT=$2
LIMIT=${3:-470}
[ $# -ge 3 ] && shift 3 || shift $#
SRC=$(cd "$(dirname "$0")/../.." && pwd)
mkdir -p "$OUT"
t0=$(date +%s)
# The bundle into OMNI_SITE (default /tmp/omni-site), the .whl/ wheels (blake3: vLLM hashes
# multimodal inputs with it; py-spy for `--profile-s`), the environment.
. "$SRC/deploy/gpu/site.sh"
used=$(( $(date +%s) - t0 ))
BUDGET=$(( LIMIT - used - 35 ))
echo "installed in $used s; bench budget $BUDGET s"
export VLLM_USE_V2_MODEL_RUNNER=1
W=$(mktemp -d /tmp/bench-XXXXXX)  # this run's work folder (models, sockets, sidecar logs)
TMPDIR=$W timeout $(( BUDGET + 30 )) python3 -m bench.gpu --budget-s "$BUDGET" --out "$OUT" --raw "$OUT" \
  --benchmarks "$OUT/BENCHMARKS.md" "$@" > "$OUT/bench.log" 2>&1
echo "bench.gpu rc=$? after $(( $(date +%s) - t0 )) s"
cp "$W"/omni-gpu-ab-*/*-sidecar.log "$W"/omni-gpu-ab-*/refusal.log "$OUT/" 2>/dev/null
grep -v '^(' "$OUT/bench.log" | grep -v '^\[W' | tail -30
exit 0
