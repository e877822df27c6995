# Sourced by the deploy/gpu/run_*.sh scripts, with B (the bundle) and OUT set: installs the bundle
# into $SITE (/tmp/omni-site; once per machine, deploy/gpu/install_once.sh) and enters the source
# tree ($SRC); $t0 is the run's start.
SRC=$(cd "$(dirname "$0")/../.." && pwd)
SITE=/tmp/omni-site
mkdir -p "$OUT"
t0=$(date +%s)
OMNI_SITE=$SITE sh "$SRC/deploy/gpu/install_once.sh" "$B" "$OUT" || exit 1
echo "installed in $(( $(date +%s) - t0 )) s"
cd "$SRC"  # `python -m` children put the working directory first on sys.path
