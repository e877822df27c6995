#!/bin/sh
# Upgrade the hook code without restarting vLLM: rebuild and recreate the sidecar only.
#   deploy/upgrade.sh [compose file]     (default deploy/docker-compose.yml)
# The old sidecar gets SIGTERM and drains; the new one binds the same socket.
# Until hot takeover with state handover lands (issue #5), requests in flight
# while the sidecar is replaced lose their hook state.
set -eu
FILE=${1:-deploy/docker-compose.yml}
docker compose -f "$FILE" build sidecar
docker compose -f "$FILE" up -d --no-deps sidecar
for i in $(seq 1 30); do
  if docker compose -f "$FILE" exec -T sidecar omni-sidecar status --timeout 3 >/dev/null 2>&1; then
    echo "sidecar upgraded and healthy; vLLM kept running"
    exit 0
  fi
  sleep 2
done
echo "new sidecar is not healthy: docker compose -f $FILE logs sidecar" >&2
exit 1
