#!/bin/sh
# Speech serving side by side on one GPU (deploy/gpu/speech_serving.py says what and how):
#   deploy/gpu/run_speech.sh BUNDLE_DIR OUT_DIR [LIMIT_S] [speech_serving.py options...]
#   (with --clone, a Base checkpoint is built and requests clone voices from reference audio)
# installs the bundle (built with BUNDLE_SM=90 BUNDLE_NO_JIT_HEADERS=1 BUNDLE_OMNI=1 BUNDLE_SERVE=1,
# or an older one with the serving wheels in the repository's .whl/) into /tmp/omni-site
# (deploy/gpu/site.sh), takes the tiny Qwen3-TTS checkpoint of the published layout from
# .gpu-speech-model (built here and carried: 1.1 MB) or builds it there (a cold import of torch,
# vLLM and vllm-omni's classes: ~50 s the servers would wait for), serves it with vllm-omni 0.26's
# own server and with omni-serve, and leaves in OUT_DIR: speech-serving.json (docs/bench/gpu/),
# speech-serving-rows.md (BENCHMARKS.md), speech.log and the servers' log tails. LIMIT_S (default
# 585) bounds the whole run, install included: the servers get all of it to start but what the
# measurement needs (speech_serving.py's MEASURE_MIN_S and STOP_RESERVE_S; vllm-omni's own takes
# ~300 s), the levels share what is left after.
# Recipe (the bundle 55.1 MiB, the 2.4 MB tree and the 1.1 MB checkpoint within the 64 MiB a
# device call carries):
#   here:  BUNDLE_SM=90 BUNDLE_NO_JIT_HEADERS=1 BUNDLE_OMNI=1 BUNDLE_SERVE=1 \
#            deploy/gpu/build_bundle.sh .gpu-bundle-serve       (an ignored folder; no BUNDLE_PROFILER)
#          VLLM_PLUGINS=omni_sidecar_shim python -m tests.tiny_models.qwen3_tts .gpu-speech-model   (ignored;
#            vLLM 0.26 and vllm-omni 0.26 importable: on CPU, tools/compat.py's 0.26.0 venv with the
#            repository, its vllm-omni-0.26.0 folder, tests/support/no_torchvision and torchaudio_stub on
#            PYTHONPATH, and transformers 5.17 (the H200 host's) or 5.19 first on it: 5.24's Mimi encoder
#            has other modules. Both give the same bytes: the same classes, seeds and torch as a build there)
#   there: carry [".gpu-bundle-serve", ".gpu-speech-model"], timeout_s 600,
#            OMNI_COMMIT=<the commit sent> sh deploy/gpu/run_speech.sh .gpu-bundle-serve $OUT 585
set -u
B=$1 OUT=$2 LIMIT=585
shift 2
case "${1:-}" in [0-9]*) LIMIT=$1; shift ;; esac  # the options follow, with or without LIMIT_S
SRC=$(cd "$(dirname "$0")/../.." && pwd)
mkdir -p "$OUT"
t0=$(date +%s)
. "$SRC/deploy/gpu/site.sh"  # the bundle, the .whl/ wheels (uvicorn, ... where the bundle lacks them), the environment
echo "installed in $(( $(date +%s) - t0 )) s"
W=$(mktemp -d /tmp/speech-XXXXXX)  # private: the sidecars' sockets live there
# The carried checkpoint if it is this tree's (its stamp), else one built here. A server that cannot
# import its front end exits at once: the run's notes name it, with its log's last line.
STAMP=$(sed -n 's/^STAMP = "\(.*\)"$/\1/p' "$SRC/tests/tiny_models/qwen3_tts.py")
KIND=""  # --clone (speech_serving.py's): a Base checkpoint, built here
case " $* " in *" --clone "*) KIND=--base ;; esac
if [ -z "$KIND" ] && grep -qs "\"stamp\": \"$STAMP\"" "$SRC/.gpu-speech-model/omni_tiny.json"; then
  cp -r "$SRC/.gpu-speech-model" "$W/model" && chmod -R u+w "$W/model"  # speech_serving.py edits its config.json
  echo "checkpoint carried ($STAMP)"
elif ! VLLM_PLUGINS=omni_sidecar_shim python3 -m tests.tiny_models.qwen3_tts "$W/model" $KIND > "$OUT/model.log" 2>&1; then
  tail -30 "$OUT/model.log"; rm -rf "$W"; exit 1
fi
echo "checkpoint ready after $(( $(date +%s) - t0 )) s"
left=$(( LIMIT - ($(date +%s) - t0) - 15 ))
timeout "$left" python3 "$SRC/deploy/gpu/speech_serving.py" --model "$W/model" --work "$W" \
  --result "$OUT/speech-serving.json" --limit-s "$(( left - 10 ))" "$@" > "$OUT/speech.log" 2>&1
echo "speech_serving.py rc=$? after $(( $(date +%s) - t0 )) s"
grep -v '^\[W' "$OUT/speech.log" | tail -40
for f in "$W"/*.log "$W"/ours-run/*.log; do echo "=== $(basename "$f")"; grep -E "patch|Error|error|Traceback" "$f" | tail -30; grep -A60 "Error raised in subprocess" "$f" | head -80; tail -30 "$f"; done \
  > "$OUT/server-logs.txt" 2>/dev/null
rm -f "$OUT/install.log" "$OUT/model.log"
rm -rf "$W"
exit 0
