#!/bin/sh
# The GPU parity check in one go on a bare GPU host (docs/ARCHITECTURE.md, "GPU bundle"):
#   [PARITY_LIMIT_S=510] deploy/gpu/run_parity.sh BUNDLE_DIR OUT_DIR [parity.py options...]
# (`--part talker` / `--part code2wav` for half of the engines each; their parity.json files merge
# with `python3 deploy/gpu/parity.py --merge A/parity.json B/parity.json --result FILE`)
# installs the bundle (built with BUNDLE_SM=90 BUNDLE_NO_JIT_HEADERS=1 BUNDLE_OMNI=1, and
# BUNDLE_PROFILER=1 for the py-spy summary) into /tmp/omni-site, builds the tiny checkpoint of the
# published layout (tests/tiny_models/qwen3_tts.py), runs the CUDA-only tests (skipped on CPU), then
# deploy/gpu/parity.py, and leaves in OUT_DIR: vllm-omni-parity.json (docs/bench/gpu/) and its
# BENCHMARKS.md rows, parity.json (every figure), parity.log, profiles.txt (py-spy, with
# `--profile-set c8-greedy`), tests.log and the engines' log tails.
# Time on the H200: install and checkpoint ~75 s; `--part talker` ~2 min of engine start (vllm-omni's
# talker_mtp graphs and code predictor compile) then 4 timed rounds of every setting in ~1-2 min;
# `--part code2wav` ~1 min after the install.
set -u
B=$1 OUT=$2 LIMIT=${PARITY_LIMIT_S:-510}  # the whole run, install included
shift 2
. "$(dirname "$0")/bundle_setup.sh"  # SRC, SITE, t0; the bundle installed; in $SRC
# py-spy: pip --target skips a bin/ the vLLM tree brought already; a folder of its own then.
if [ ! -x "$SITE/bin/py-spy" ] && ls "$B"/wheels/py_spy-*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/omni-pyspy "$B"/wheels/py_spy-*.whl
fi
export PATH="$SITE/bin:/tmp/omni-pyspy/bin:$PATH" PYTHONPATH="$SRC:$SITE" VLLM_USE_FLASHINFER_SAMPLER=0 \
  HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
W=$(mktemp -d /tmp/parity-XXXXXX)  # private: the sidecars' sockets live there
VLLM_PLUGINS=omni_sidecar_shim python3 -m tests.tiny_models.qwen3_tts "$W/model" > "$OUT/model.log" 2>&1 \
  || { tail -30 "$OUT/model.log"; exit 1; }
# The CUDA-only tests (skipped on CPU), in the background while the engines start.
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_embeds_graph.py tests/test_mtp_graphs.py \
  tests/test_plan_transfer.py tests/test_omni_columns.py > "$OUT/tests.log" 2>&1 &
TESTS=$!
left=$(( LIMIT - ($(date +%s) - t0) - 20 ))
# Timed rounds stop 45 s before the end and a stuck engine is killed 25 s before it: the report is written.
timeout "$left" python3 "$SRC/deploy/gpu/parity.py" --model "$W/model" --out "$W" \
  --deadline-s $(( left - 45 )) --engine-timeout-s $(( left - 25 )) \
  --result "$OUT/vllm-omni-parity.json" "$@" > "$OUT/parity.log" 2>&1
echo "parity.py rc=$? after $(( $(date +%s) - t0 )) s"
wait $TESTS
tail -3 "$OUT/tests.log"
grep -v '^\[W' "$OUT/parity.log" | tail -40
cp "$W/parity.json" "$OUT/" 2>/dev/null
for f in "$W"/profile-*.txt; do [ -f "$f" ] && { echo "=== $(basename "$f")"; cat "$f"; echo; }; done > "$OUT/profiles.txt"
for f in "$W"/*.log; do echo "=== $(basename "$f")"; grep -E "patch|Error|error|Traceback|Capturing|talker_mtp|py-spy|warm-up" "$f" | tail -40; tail -25 "$f"; done \
  > "$OUT/engine-logs.txt" 2>/dev/null
rm -f "$OUT/install.log" "$OUT/model.log"
exit 0
