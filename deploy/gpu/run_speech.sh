#!/bin/sh
# Speech serving side by side on one GPU (deploy/gpu/speech_serving.py says what and how):
#   deploy/gpu/run_speech.sh BUNDLE_DIR OUT_DIR [LIMIT_S] [speech_serving.py options...]
# installs the bundle (built with BUNDLE_SM=90 BUNDLE_NO_JIT_HEADERS=1 BUNDLE_OMNI=1 BUNDLE_SERVE=1,
# or an older one with the serving wheels in the repository's .whl/) into /tmp/omni-site
# (deploy/gpu/site.sh), builds the tiny Qwen3-TTS checkpoint of the published layout, checks that
# both servers' modules import (imports.txt: what is missing, if anything), serves the checkpoint
# with vllm-omni 0.26's own server and with omni-serve, and leaves in OUT_DIR:
# speech-serving.json (docs/bench/gpu/), speech-serving-rows.md (BENCHMARKS.md), speech.log and
# the servers' log tails. LIMIT_S (default 470) bounds the whole run, install included.
# Recipe (the bundle 55.1 MiB, with the 2.4 MB tree within the 64 MiB a device call carries):
#   here:  BUNDLE_SM=90 BUNDLE_NO_JIT_HEADERS=1 BUNDLE_OMNI=1 BUNDLE_SERVE=1 \
#            deploy/gpu/build_bundle.sh .gpu-bundle-serve       (an ignored folder; no BUNDLE_PROFILER)
#   there: carry [".gpu-bundle-serve"], timeout_s 560,
#            OMNI_COMMIT=<the commit sent> sh deploy/gpu/run_speech.sh .gpu-bundle-serve $OUT 500
set -u
B=$1 OUT=$2 LIMIT=470
shift 2
case "${1:-}" in [0-9]*) LIMIT=$1; shift ;; esac  # the options follow, with or without LIMIT_S
SRC=$(cd "$(dirname "$0")/../.." && pwd)
mkdir -p "$OUT"
rm -f "$OUT/imports.txt"
t0=$(date +%s)
. "$SRC/deploy/gpu/site.sh"  # the bundle, the .whl/ wheels (uvicorn, ... where the bundle lacks them), the environment
echo "installed in $(( $(date +%s) - t0 )) s"
W=$(mktemp -d /tmp/speech-XXXXXX)  # private: the sidecars' sockets live there
# The checkpoint's build and each server's import probe run side by side: on a fresh machine each
# is a cold import of torch and vLLM (tens of seconds), and the servers' start needs the time.
VLLM_PLUGINS=omni_sidecar_shim python3 -m tests.tiny_models.qwen3_tts "$W/model" > "$OUT/model.log" 2>&1 &
model_pid=$!
# Each server's front end imports, each in a process of its own (vllm-omni's patches stay in its);
# a server that cannot is left out of the run (imports.txt: the first module it misses).
python3 -c "import uvicorn, fastapi, omni_serve.api.server" > "$W/probe-ours.txt" 2>&1 &
ours_pid=$!
python3 -c "import uvloop, vllm_omni.entrypoints.openai.api_server, vllm_omni.entrypoints.cli.serve, vllm.entrypoints.serve.instrumentator.metrics" \
  > "$W/probe-vllm-omni.txt" 2>&1 &
omni_pid=$!
wait "$model_pid" || { tail -30 "$OUT/model.log"; kill "$ours_pid" "$omni_pid" 2>/dev/null; rm -rf "$W"; exit 1; }
SERVERS=""
for name in ours vllm-omni; do
  if [ "$name" = ours ]; then pid=$ours_pid; else pid=$omni_pid; fi
  if wait "$pid"; then
    echo "$name: imports" >> "$OUT/imports.txt"; SERVERS="$SERVERS${SERVERS:+,}$name"
  else
    echo "$name: $(grep -E 'Error' "$W/probe-$name.txt" | tail -1)" >> "$OUT/imports.txt"
  fi
done
cat "$OUT/imports.txt"
echo "checkpoint built and imports probed after $(( $(date +%s) - t0 )) s"
[ -n "$SERVERS" ] || { rm -rf "$W"; exit 1; }
left=$(( LIMIT - ($(date +%s) - t0) - 15 ))
timeout "$left" python3 "$SRC/deploy/gpu/speech_serving.py" --model "$W/model" --work "$W" --servers "$SERVERS" \
  --result "$OUT/speech-serving.json" --limit-s "$(( left - 10 ))" "$@" > "$OUT/speech.log" 2>&1
echo "speech_serving.py rc=$? after $(( $(date +%s) - t0 )) s"
grep -v '^\[W' "$OUT/speech.log" | tail -40
for f in "$W"/*.log "$W"/ours-run/*.log; do echo "=== $(basename "$f")"; grep -E "patch|Error|error|Traceback" "$f" | tail -30; grep -A60 "Error raised in subprocess" "$f" | head -80; tail -30 "$f"; done \
  > "$OUT/server-logs.txt" 2>/dev/null
rm -f "$OUT/install.log" "$OUT/model.log"
rm -rf "$W"
exit 0
