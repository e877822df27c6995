#!/bin/sh
# Hot-upgrade the hook code without restarting vLLM (and without failing requests):
#   deploy/upgrade.sh [compose file]     (default deploy/docker-compose.yml)
# 1. build the new sidecar image;
# 2. start a second sidecar container next to the running one: its
#    `serve --takeover-if-running` takes over state and shims at a step boundary,
#    and the old one drains and exits 0 (restart: on-failure leaves it down);
# 3. settle back to one sidecar container.
# Needs Docker Compose v2 (`docker compose`). Without a running sidecar, step 2 just starts one.
set -eu
FILE=${1:-deploy/docker-compose.yml}
dc() { docker compose -f "$FILE" "$@"; }
old=$(dc ps -q sidecar | head -n 1)
dc build sidecar
dc up -d --no-deps --no-recreate --scale sidecar=2 sidecar
for i in $(seq 1 60); do
  if [ -z "$old" ] || [ "$(docker inspect -f '{{.State.Running}}' "$old" 2>/dev/null)" != "true" ]; then
    dc up -d --no-deps --no-recreate --scale sidecar=1 sidecar
    dc exec -T sidecar omni-sidecar status --timeout 3 >/dev/null
    echo "sidecar upgraded by takeover; vLLM kept running"
    exit 0
  fi
  sleep 1
done
echo "the old sidecar did not hand over within 60 s; see: docker compose -f $FILE logs sidecar" >&2
exit 1
