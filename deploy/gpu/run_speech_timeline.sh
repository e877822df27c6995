#!/bin/sh
# Where omni-serve's first audio waits on the H200 (bench/speech_timeline.py says what it measures):
#   deploy/gpu/run_speech_timeline.sh BUNDLE_DIR OUT_DIR [LIMIT_S] [speech_timeline.py options...]
# installs the bundle as run_speech.sh does (the same bundle), builds the tiny Qwen3-TTS checkpoint,
# writes omni-serve's config of the side-by-side run (deploy/gpu/speech_serving.py's, vllm-omni's
# classes through the shim) and runs the timeline on it: this tree's server, and with BASE_TREE set
# (a folder that travels with the call, e.g. `mkdir .base-tree && git archive a775606 | tar -x -C
# .base-tree`: untracked, or carried where it is ignored) that tree's beside it, taking turns. Leaves speech-timeline.json, speech-timeline.log and the servers' log
# tails in OUT_DIR. LIMIT_S (default 500) bounds the whole run, install included.
#   there: carry [".gpu-bundle-serve"(, ".base-tree")], timeout_s 560,
#            [BASE_TREE=.base-tree] sh deploy/gpu/run_speech_timeline.sh .gpu-bundle-serve $OUT 520 --levels 16,64 --rounds 2
set -u
B=$1 OUT=$2 LIMIT=500
shift 2
case "${1:-}" in [0-9]*) LIMIT=$1; shift ;; esac
SRC=$(cd "$(dirname "$0")/../.." && pwd)
mkdir -p "$OUT"
t0=$(date +%s)
. "$SRC/deploy/gpu/site.sh"
echo "installed in $(( $(date +%s) - t0 )) s"
W=$(mktemp -d /tmp/timeline-XXXXXX)
VLLM_PLUGINS=omni_sidecar_shim python3 -m tests.tiny_models.qwen3_tts "$W/model" > "$OUT/model.log" 2>&1 \
  || { tail -30 "$OUT/model.log"; rm -rf "$W"; exit 1; }
PYTHONPATH="$SRC/deploy/gpu:$PYTHONPATH" python3 -c "
import sys; from pathlib import Path; import speech_serving as s
model, work = Path(sys.argv[1]), Path(sys.argv[2])
s.with_speakers(model); print(s.ours_pipeline(work, model, 48, 25))" "$W/model" "$W" > "$W/pipeline.txt" || { rm -rf "$W"; exit 1; }
BASE=""
[ -n "${BASE_TREE:-}" ] && BASE="--tree base=$(cd "$BASE_TREE" && pwd)"
left=$(( LIMIT - ($(date +%s) - t0) - 15 ))
# shellcheck disable=SC2086
VLLM_PLUGINS=omni_sidecar_shim timeout "$left" \
  python3 "$SRC/bench/speech_timeline.py" --tree "new=$SRC" $BASE --pipeline "$(cat "$W/pipeline.txt")" \
  --voices vivian,ryan --sample-rate 24000 --waves 2 --work "$W" --result "$OUT/speech-timeline.json" \
  --limit-s "$(( left - 30 ))" "$@" > "$OUT/speech-timeline.log" 2>&1
echo "speech_timeline.py rc=$? after $(( $(date +%s) - t0 )) s"
grep -v '^\[W' "$OUT/speech-timeline.log" | tail -40
for f in "$W"/*.log "$W"/run-*/*.log; do echo "=== $(basename "$f")"; grep -E "Error|Traceback" "$f" | tail -20; tail -20 "$f"; done \
  > "$OUT/server-logs.txt" 2>/dev/null
rm -f "$OUT/install.log" "$OUT/model.log"
rm -rf "$W"
exit 0
