# Sourced by deploy/gpu/run_bench.sh and run_speech.sh (B, OUT and SRC set): installs the bundle B
# into SITE once per machine (deploy/gpu/install_once.sh), then the wheels of the repository's .whl/
# folder, if any, into a folder of their own (wheels a bundle built before it listed them; pip
# --target skips a bin/ that exists already), goes to SRC (`python -m` children put the working
# directory first on sys.path) and exports what every GPU run needs.
SITE=${OMNI_SITE:-/tmp/omni-site}
OMNI_SITE=$SITE sh "$SRC/deploy/gpu/install_once.sh" "$B" "$OUT" || exit 1
EXTRA="$SITE/.extra"
[ -d "$SRC/.whl" ] && python3 -m pip install -q --no-index --no-deps --no-compile --target "$EXTRA" "$SRC"/.whl/*.whl
cd "$SRC"
export PATH="$EXTRA/bin:$SITE/bin:$PATH" PYTHONPATH="$SRC:$SITE:$EXTRA" VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1 \
  VLLM_NO_USAGE_STATS=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
