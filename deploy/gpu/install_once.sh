#!/bin/sh
# The bundle installed into /tmp/omni-site once per machine (later runs reuse it):
#   deploy/gpu/install_once.sh BUNDLE_DIR OUT_DIR     (the install log goes to OUT_DIR on failure)
set -u
B=$1 OUT=$2
SITE=/tmp/omni-site
[ -f "$SITE/.omni-installed" ] && exit 0
if ! sh "$(dirname "$0")/install_bundle.sh" "$B" "$SITE" > "$OUT/install.log" 2>&1; then
  tail -40 "$OUT/install.log"
  exit 1
fi
touch "$SITE/.omni-installed"
