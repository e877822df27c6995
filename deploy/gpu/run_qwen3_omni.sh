#!/bin/sh
# Qwen3-Omni parity and serving on one GPU in one go (docs/ARCHITECTURE.md, "GPU bundle"):
#   deploy/gpu/run_qwen3_omni.sh BUNDLE_DIR OUT_DIR [LIMIT_S] [PARTS]
# installs the bundle into /tmp/omni-site (once per machine, deploy/gpu/site.sh: the repository's
# .whl/ wheels too; built with BUNDLE_OMNI=1 and BUNDLE_KEEP_MOE=1: Qwen3-Omni's thinker and talker
# are MoE models, whose CUDA path needs vLLM's _moe_C), builds the tiny Qwen3-Omni checkpoint of
# the published layout (tests/tiny_models/qwen3_omni.py), then runs PARTS (default parity; parity,serve runs both,
# the serve part only with SERVE_NEEDS_S left, which the parity part leaves it):
# - parity: deploy/gpu/qwen3_omni_parity.py: vllm-omni 0.26's own three stages (V1 runner) and ours
#   (three V2 engines + shim + a sidecar each), the same requests (text, and text + one generated image
#   where the checkpoint's builder had torchvision), side by side; the talkers' top-2 logprobs where
#   their tokens differ;
# - serve: omni-serve on deploy/speech/qwen3-omni-gpu.toml (the same stage classes, free-running
#   behind /v1/audio/speech, vllm-omni's hand-overs) driven by deploy/gpu/speech_serving.py: TTFA
#   and audio seconds per second at 1 and 16 concurrent streaming requests. Its HTTP front end needs
#   uvicorn and what it imports beyond the bundle: carry them in .whl/ (the recipe below).
# QWEN3_OMNI_EAGER=1: the parity part's engines eager (no torch.compile, no CUDA graphs: they start
# in seconds instead of ~3 minutes; eager TTFA figures). Either way both pipelines' talker code
# predictors are greedy, set as the model loads, before vllm-omni's runner captures its talker_mtp
# in CUDA graphs (the report's code_predictor_sampling; first_divergence where codes differ).
# LIMIT_S (default 470) bounds the whole run, install included; each part stops cleanly by then and
# reports what it has. Leaves in OUT_DIR: qwen3-omni-parity.json (docs/bench/gpu/; under
# "omni_serve" the serve part's figures), qwen3-omni.log (the table), qwen3-omni-serve.json and
# qwen3-omni-serve-rows.md, the pipelines', sidecars' and server's log tails.
# Recipe (the bundle 58.3 MiB, with the 2.4 MB tree and the 0.4 MiB .whl/ within the 64 MiB a
# device call carries):
#   here:  BUNDLE_SM=90 BUNDLE_NO_JIT_HEADERS=1 BUNDLE_OMNI=1 BUNDLE_KEEP_MOE=1 BUNDLE_PACK_WHEELS=1 \
#            deploy/gpu/build_bundle.sh .gpu-bundle-moe         (an ignored folder; no BUNDLE_PROFILER)
#          mkdir -p .whl && for w in uvicorn h11 anyio idna annotated_doc; do \
#            cp .gpu-bundle-serve/wheels/$w-*.whl .whl/; done   (or pip download them: --no-deps, cp312)
#   there: carry [".gpu-bundle-moe", ".whl"], timeout_s 560,
#            OMNI_COMMIT=<the commit sent> sh deploy/gpu/run_qwen3_omni.sh .gpu-bundle-moe $OUT 500          (the parity part)
#            OMNI_COMMIT=<the commit sent> sh deploy/gpu/run_qwen3_omni.sh .gpu-bundle-moe $OUT 500 serve    (the serve part alone)
set -u
B=$1 OUT=$2 LIMIT=${3:-470} PARTS=${4:-parity}  # parity,serve in one call leaves each too little time
SRC=$(cd "$(dirname "$0")/../.." && pwd)
SERVE_NEEDS_S=320  # the serve part: three engines started one after another (~170 s on the H200), warm-up, two levels
mkdir -p "$OUT"
t0=$(date +%s)
. "$SRC/deploy/gpu/site.sh"  # the bundle, the .whl/ wheels, the environment; the working directory is SRC
echo "installed in $(( $(date +%s) - t0 )) s"
if ! ls "$SITE"/vllm/_moe_C*.so > /dev/null 2>&1; then
  # vLLM's CUDA MoE path calls torch.ops._moe_C (topk_softmax, moe_align_block_size): no engine would run.
  why="the bundle has no vllm/_moe_C (build it with BUNDLE_KEEP_MOE=1): the MoE thinker and talker cannot run"
  echo "$why"
  printf '{"error": "%s", "command": "sh deploy/gpu/run_qwen3_omni.sh BUNDLE OUT [LIMIT_S] [PARTS]"}\n' "$why" \
    > "$OUT/qwen3-omni-parity.json"
  exit 1
fi
case ",$PARTS," in *,serve,*) SERVE=1 ;; *) SERVE=0 ;; esac
EAGER=""; [ "${QWEN3_OMNI_EAGER:-0}" = 1 ] && EAGER=--eager  # 1 only: QWEN3_OMNI_EAGER=0 is not eager
W=$(mktemp -d /tmp/qwen3-omni-XXXXXX)  # private: the sidecars' sockets live there
python3 -m tests.tiny_models.qwen3_omni "$W/model" > "$OUT/model.log" 2>&1 || { tail -30 "$OUT/model.log"; exit 1; }
case ",$PARTS," in *,parity,*)
  left=$(( LIMIT - ($(date +%s) - t0) - 15 - SERVE * SERVE_NEEDS_S ))
  timeout "$left" python3 "$SRC/deploy/gpu/qwen3_omni_parity.py" --model "$W/model" --out "$W/work" \
    --result "$OUT/qwen3-omni-parity.json" --limit-s $(( left - 10 )) $EAGER \
    > "$OUT/qwen3-omni.log" 2>&1
  echo "qwen3_omni_parity.py rc=$? after $(( $(date +%s) - t0 )) s"
  grep -v '^\[W\|^INFO\|^WARNING\|^DEBUG' "$OUT/qwen3-omni.log" | tail -30
  # A CUDA error's abort prints C++ frames (left out) after the kernel's assertion (every failing
  # thread prints it: kept once).
  for f in "$W"/work/*.log; do echo "=== $(basename "$f")"
    grep -E "patch|Error|error|Traceback|Assertion" "$f" | sed 's/block: \[[^]]*\], thread: \[[^]]*\]//' | uniq | tail -20
    grep -v '^frame #' "$f" | tail -25; done \
    > "$OUT/engine-logs.txt" 2>/dev/null
  cp "$W/work/qwen3-omni-report.json" "$OUT/" 2>/dev/null ;;
esac
left=$(( LIMIT - ($(date +%s) - t0) - 15 ))
if [ "$SERVE" = 1 ] && [ "$left" -lt "$SERVE_NEEDS_S" ]; then
  echo "serve: skipped, ${left} s left (it needs ${SERVE_NEEDS_S})"
elif [ "$SERVE" = 1 ] && ! python3 -c "import uvicorn, fastapi, omni_serve.api.server" > "$W/probe.txt" 2>&1; then
  echo "serve: skipped, omni-serve's front end does not import: $(grep -E 'Error' "$W/probe.txt" | tail -1)"
elif [ "$SERVE" = 1 ]; then
  # The shim's plugin only (vllm-omni's would patch); V2 (VLLM_USE_V2_MODEL_RUNNER is set per server there).
  VLLM_PLUGINS=omni_sidecar_shim timeout "$left" python3 "$SRC/deploy/gpu/speech_serving.py" --servers ours \
    --ours-pipeline "$SRC/deploy/speech/qwen3-omni-gpu.toml" --voices chelsie,ethan --frames 40 --levels 1,16 \
    --work "$W/serve" --result "$OUT/qwen3-omni-serve.json" --limit-s $(( left - 10 )) \
    > "$OUT/qwen3-omni-serve.log" 2>&1
  echo "speech_serving.py rc=$? after $(( $(date +%s) - t0 )) s"
  grep -v '^\[W' "$OUT/qwen3-omni-serve.log" | tail -20
  for f in "$W"/serve/*.log "$W"/serve/ours-run/*.log; do echo "=== $(basename "$f")"; grep -E "Error|error|Traceback" "$f" | tail -30; tail -30 "$f"; done \
    > "$OUT/server-logs.txt" 2>/dev/null
  # Its figures beside the parity's (when the parity part wrote its JSON).
  python3 -c 'import json, sys; from pathlib import Path; p, s = map(Path, sys.argv[1:])
if p.is_file() and s.is_file(): p.write_text(json.dumps({**json.loads(p.read_text()), "omni_serve": json.loads(s.read_text())}, indent=1) + "\n")' \
    "$OUT/qwen3-omni-parity.json" "$OUT/qwen3-omni-serve.json"
fi
rm -f "$OUT/install.log" "$OUT/model.log"
rm -rf "$W"
exit 0
