#!/bin/sh
# Session 17: main as it stands, on one H200 (what issue #15's closing note cites).
#   sh docs/bench/gpu/issue15-h200-s17/run17.sh LIMIT_S "PARTS" [bench.gpu options...]
# PARTS, in order, from: tests (the CUDA tests), stepcost (pass-through host cost, 3 rounds of
# 0.5 and 2.5 ms forwards), bench (deploy/gpu/run_bench.sh with the options, in what is left of
# LIMIT_S). Everything lands in $OUT/r, tarred to $OUT/r.tgz at the end.
set -u
LIMIT=$1; PARTS=$2; shift 2
SRC=$PWD; SITE=/tmp/omni-site; EXTRA=$SITE/.extra; R=$OUT/r; mkdir -p "$R"
t0=$(date +%s)
if [ ! -f $SITE/.omni-installed ]; then
  sh deploy/gpu/install_bundle.sh .cache/h-gpu/bundle $SITE > "$R/install.log" 2>&1 && touch $SITE/.omni-installed \
    || { tail -20 "$R/install.log"; exit 1; }
fi
[ -d .whl ] && python3 -m pip install -q --no-index --no-deps --no-compile --target "$EXTRA" .whl/*.whl
echo "installed at $(( $(date +%s) - t0 )) s"
export PATH="$EXTRA/bin:$SITE/bin:$PATH" HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 PYTHONUNBUFFERED=1 \
  TOKENIZERS_PARALLELISM=false VLLM_USE_V2_MODEL_RUNNER=1 VLLM_USE_FLASHINFER_SAMPLER=0
(nproc; grep "model name" /proc/cpuinfo | head -1; nvidia-smi --query-gpu=name,driver_version --format=csv) > "$R/host.txt" 2>&1
for part in $PARTS; do
  case $part in
  tests)
    PYTHONPATH="$SRC:$SITE:$EXTRA" timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_embeds_graph.py \
      tests/test_omni_columns.py tests/test_plan_transfer.py tests/test_plan_trees.py tests/test_overlay_rows.py \
      tests/test_graph_kwargs.py > "$R/cuda_tests.txt" 2>&1
    tail -3 "$R/cuda_tests.txt";;
  stepcost)
    for round in 1 2 3; do
      for f in 0.5 2.5; do
        line=$(PYTHONPATH="$SRC:$SITE" timeout 60 python3 -m bench.step_cost --steps 1500 --only passthrough \
          --forward-ms $f 2>&1 | grep "host cost")
        echo "round $round forward $f: $line" | tee -a "$R/step_cost.txt"
      done
    done;;
  bench)
    left=$(( LIMIT - ($(date +%s) - t0) - 25 ))
    sh deploy/gpu/run_bench.sh .cache/h-gpu/bundle "$R/bench" $left "$@";;
  esac
  echo "$part done at $(( $(date +%s) - t0 )) s"
done
(cd "$OUT" && tar -czf r.tgz r && rm -rf r)
