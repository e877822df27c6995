#!/bin/sh
# Session 16 call 4: pass-through host cost, 32baaeb (.cache/old-tree) vs this tree, alternating.
set -u
SRC=$PWD; SITE=/tmp/omni-site; R=$OUT/r; mkdir -p $R
t0=$(date +%s)
if [ ! -f $SITE/.omni-installed ]; then
  sh deploy/gpu/install_bundle.sh .cache/h-gpu/bundle $SITE > $R/install.log 2>&1 && touch $SITE/.omni-installed || { tail -20 $R/install.log; exit 1; }
fi
echo "installed at $(( $(date +%s) - t0 )) s"
export HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
(nproc; grep "model name" /proc/cpuinfo | head -1) > $R/host.txt
for round in 1 2 3; do
  for tree in old new; do
    if [ $tree = old ]; then T=$SRC/.cache/old-tree; else T=$SRC; fi
    for f in 0.5 2.5; do
      line=$(cd $T && PYTHONPATH="$T:$SITE" timeout 60 python3 -m bench.step_cost --steps 1500 --only passthrough --forward-ms $f 2>&1 | grep "host cost")
      echo "round $round $tree forward $f: $line" | tee -a $R/step_cost_ab.txt
    done
  done
done
echo "done at $(( $(date +%s) - t0 )) s"
(cd $OUT && tar -czf r.tgz r && rm -rf r)
