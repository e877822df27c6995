#!/bin/sh
# Air-gapped install bundle for a GPU host with no network (docs/ARCHITECTURE.md, "GPU bundle"):
# vLLM 0.26.0 for torch 2.11.0+cu130 / Python 3.12, minus what an H200 run does not load,
# as a tar.xz split into parts of PART_MIB, plus the wheels such a host lacks.
#   deploy/gpu/build_bundle.sh OUT_DIR [PART_MIB]       (here, with network)
#   deploy/gpu/install_bundle.sh BUNDLE_DIR TARGET_DIR  (there, offline)
# Options (environment), for bundles that must travel small (a 64 MiB limit):
#   BUNDLE_SM=90        keep only the cubins of that GPU generation (deploy/gpu/keep_sm.py; PTX stays)
#   BUNDLE_NO_JIT_HEADERS=1  leave out the JIT headers of DeepGEMM (FP8) and the SM100 FMHA
#   (FlashAttention 3 stays: vllm.vllm_flash_attn refuses to import without FA2 or FA3, and the
#   model loader imports it)
#   BUNDLE_OMNI=1       add vllm-omni 0.26.0 (its package, minus sample audio) and what it needs to import
#   BUNDLE_SERVE=1      add what HTTP serving imports beyond the engines (omni-serve's and vllm-omni's front
#                       ends: deploy/gpu/run_speech.sh; a server that cannot import its front end
#                       does not start, and the run's notes give its log's last line)
#   BUNDLE_KEEP_MOE=1   keep vLLM's MoE ops (vllm/_moe_C*: Qwen3-Omni's thinker and talker,
#                       deploy/gpu/run_qwen3_omni.sh)
#   BUNDLE_PROFILER=1   add py-spy (`python -m bench.gpu --profile-s N`; installed into TARGET_DIR/bin)
#   BUNDLE_PACK_WHEELS=1  unpack the wheels (but the project's own and any with a .data folder) into the
#                       tree: ~8 MB smaller, what a MoE bundle needs to fit the 64 MiB
set -eu
OUT=${1:-gpu-bundle}
PART_MIB=${2:-60}
PY=${PY:-python3}
PLAT="--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
--platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform manylinux_2_31_x86_64"
DL="$PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $PLAT"
mkdir -p "$OUT/wheels" "$OUT/work"
$DL -d "$OUT/work" vllm==0.26.0
WHEEL=$(ls "$OUT"/work/vllm-0.26.0-*.whl | head -n 1)
rm -rf "$OUT/work/tree" && mkdir -p "$OUT/work/tree"
$PY -m zipfile -e "$WHEEL" "$OUT/work/tree"
T="$OUT/work/tree"
# Not loaded on an H200 (FA3 is selected for compute capability 9.x; FA2 only for ALiBi /
# batch-invariant / explicit version 2, import-guarded), the Rust front end, MoE ops (keep them
# for MoE models: BUNDLE_KEEP_MOE=1), and deep_gemm builds for other Pythons.
rm -f "$T/vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so"
rm -rf "$T/vllm/vllm-rs"
[ "${BUNDLE_KEEP_MOE:-0}" = 1 ] || rm -f "$T/vllm/_moe_C_stable_libtorch.abi3.so"
find "$T/vllm/third_party" -name '_C.cpython-3*.so' ! -name '*cpython-312*' -delete 2>/dev/null || true
if [ "${BUNDLE_NO_JIT_HEADERS:-0}" = 1 ]; then
  rm -rf "$T/vllm/third_party/deep_gemm/include" "$T/vllm/third_party/fmha_sm100/cutlass"
fi
[ -z "${BUNDLE_SM:-}" ] || find "$T/vllm" -name '*.so' -exec $PY "$(dirname "$0")/keep_sm.py" "$BUNDLE_SM" {} +
if [ "${BUNDLE_OMNI:-0}" = 1 ]; then
  # vllm-omni 0.26.0 pairs with vLLM 0.26.0; importing it and its Qwen3-TTS talker needs only these
  # (the host has torch, torchaudio, transformers <= 5.20, numpy, PyYAML).
  $DL -d "$OUT/work" vllm-omni==0.26.0
  $PY -m zipfile -e "$OUT"/work/vllm_omni-0.26.0-*.whl "$T"
  find "$T/vllm_omni" \( -name '*.wav' -o -name '*.npy' \) -delete
  for spec in aenum omegaconf prettytable wcwidth soundfile cffi pycparser; do
    $DL -d "$OUT/wheels" "$spec"
  done
  # Its AR worker imports diffusers, its orchestrator janus, its tokenizers loguru: pure Python,
  # unpacked into the tree (xz packs them tighter than their wheels).
  for spec in diffusers janus loguru; do
    $DL -d "$OUT/work/omni" "$spec"
  done
  for w in "$OUT"/work/omni/*.whl; do $PY -m zipfile -e "$w" "$T"; done
fi
# What the host lacks (its Python 3.12 has torch 2.11.0+cu130 and little else); einops: vLLM's Qwen2-VL /
# Qwen2.5-VL encoders (Qwen3-Omni's thinker) and vllm-omni's server import it at the top; truststore:
# httpx2 and httpcore2 (openai's client) import it at the top.
for spec in pydantic==2.14.4 pydantic_core==2.50.5 annotated_types typing_inspection pyzmq==27.3.0 \
    msgspec==0.23.0 cbor2 pybase64 cachetools openai httpx2 sniffio openai_harmony llguidance==1.7.6 \
    xgrammar==0.2.7 apache_tvm_ffi==0.1.10 partial_json_parser fastapi==0.136.3 starlette==1.10.0 \
    httpcore2 truststore jiter setproctitle prometheus_client blake3 einops; do
  $DL -d "$OUT/wheels" "$spec"
done
# uvloop, pillow, aiohttp (and its multidict, yarl, frozenlist, ...) and tiktoken are the host's: every
# engine run imports them at start (vllm.v1.utils, vllm.multimodal, vllm_omni's tokenizer configs), and
# carrying them (15 MiB) would put a bundle that serves over the 64 MiB a device call carries.
if [ "${BUNDLE_SERVE:-0}" = 1 ]; then
  # vllm-omni's api_server imports at the top: watchfiles (vllm.entrypoints.launcher's SSL refresher),
  # model-hosting-container-standards and jmespath (vLLM's SageMaker and LoRA routers), and through
  # vllm.tokenizers.mistral mistral_common with jsonschema, pydantic-extra-types, pycountry, ijson,
  # pydantic-settings, python-dotenv; when it builds its app, prometheus-fastapi-instrumentator (vLLM's
  # /metrics router).
  for spec in uvicorn h11 anyio idna annotated-doc python-multipart httpx httpcore certifi email-validator dnspython \
      antlr4-python3-runtime watchfiles model-hosting-container-standards jmespath jsonschema referencing rpds-py \
      jsonschema-specifications pydantic-extra-types ijson pydantic-settings python-dotenv \
      prometheus-fastapi-instrumentator; do
    $DL -d "$OUT/wheels" "$spec"
  done
  # Into the tree without their data (mistral's own tokenizer files, pycountry's translations: 35 MiB
  # the Qwen3-TTS runs never read).
  $DL -d "$OUT/work/serve" mistral_common pycountry
  for w in "$OUT"/work/serve/*.whl; do $PY -m zipfile -e "$w" "$T"; done
  rm -rf "$T/mistral_common/data" "$T/pycountry/locales" "$T/pycountry/tests"
fi
[ "${BUNDLE_PROFILER:-0}" = 1 ] && $DL -d "$OUT/wheels" py-spy
if [ "${BUNDLE_PACK_WHEELS:-0}" = 1 ]; then
  # Wheels without a .data folder unpack to what pip --target installs; xz packs them ~40% tighter.
  for w in "$OUT"/wheels/*.whl; do
    if ! $PY -m zipfile -l "$w" | grep -q '\.data/'; then $PY -m zipfile -e "$w" "$T" && rm -f "$w"; fi
  done
fi
# xz -9: its 64 MiB window spans the big kernel libraries' repeats (FA3 packs to 8 MB, not 10.6 at -6)
XZ_OPT=${XZ_OPT:--9} tar -C "$T" -cJf "$OUT/vllm-0.26.0-tree.tar.xz" .
split -b "${PART_MIB}m" -d "$OUT/vllm-0.26.0-tree.tar.xz" "$OUT/vllm-tree.part-"
rm -f "$OUT/vllm-0.26.0-tree.tar.xz"
# The project itself, as a wheel (no dependencies: the host has them from above).
$PY -m pip wheel -q --no-deps -w "$OUT/wheels" "$(dirname "$0")/../.."
rm -rf "$OUT/work"
(cd "$OUT" && sha256sum vllm-tree.part-* wheels/*.whl > SHA256SUMS)
du -sh "$OUT"/vllm-tree.part-* "$OUT/wheels" | sed 's/^/  /'
echo "bundle in $OUT: copy it to the host, then deploy/gpu/install_bundle.sh $OUT /opt/omni-site"
