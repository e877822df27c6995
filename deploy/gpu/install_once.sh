#!/bin/sh
# The bundle installed into OMNI_SITE (default /tmp/omni-site) once per machine: a later run of the
# same bundle reuses it; another bundle (the serving one after the MoE one, on a machine still warm)
# replaces it, since the marker holds the hash of the bundle's SHA256SUMS.
#   deploy/gpu/install_once.sh BUNDLE_DIR OUT_DIR     (the install log goes to OUT_DIR on failure)
set -u
B=$1 OUT=$2
SITE=${OMNI_SITE:-/tmp/omni-site}
ID=$(sha256sum < "$B/SHA256SUMS" | cut -c1-64)
if [ "$(cat "$SITE/.omni-installed" 2>/dev/null)" = "$ID" ]; then
  echo "bundle already installed in $SITE"
  exit 0
fi
rm -rf "$SITE"
if ! sh "$(dirname "$0")/install_bundle.sh" "$B" "$SITE" > "$OUT/install.log" 2>&1; then
  tail -40 "$OUT/install.log"
  exit 1
fi
echo "$ID" > "$SITE/.omni-installed"
