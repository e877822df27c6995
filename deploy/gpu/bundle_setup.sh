# Sourced by the deploy/gpu/run_*.sh scripts, with B (the bundle) and OUT set: installs the bundle
# into $SITE (/tmp/omni-site) and enters the source tree ($SRC); $t0 is the run's start.
SRC=$(cd "$(dirname "$0")/../.." && pwd)
SITE=/tmp/omni-site
mkdir -p "$OUT"
t0=$(date +%s)
if ! sh "$SRC/deploy/gpu/install_bundle.sh" "$B" "$SITE" > "$OUT/install.log" 2>&1; then
  tail -40 "$OUT/install.log"
  exit 1
fi
echo "installed in $(( $(date +%s) - t0 )) s"
cd "$SRC"  # `python -m` children put the working directory first on sys.path
