#!/bin/sh
# Hot-upgrade the hook code without restarting vLLM (and without failing requests):
#   deploy/upgrade.sh [--no-build] [compose file]     (default deploy/docker-compose.yml)
# 1. build the new sidecar image (--no-build: it is built already, e.g. offline with a local
#    base as in README's "Building without an image registry");
# 2. start a second sidecar container next to the running one: its
#    `serve --takeover-if-running` takes over state and shims at a step boundary,
#    and the old one drains and exits 0 (restart: on-failure leaves it down);
# 3. remove the old container, leaving one sidecar container (the new one).
# Needs Docker Compose v2 (`docker compose`). Without a running sidecar, step 2 just starts one.
# COMPOSE_PROJECT_NAME and the compose file's variables come from the environment, as for compose.
set -eu
BUILD=1
if [ "${1:-}" = "--no-build" ]; then BUILD=0; shift; fi
FILE=${1:-deploy/docker-compose.yml}
dc() { docker compose -f "$FILE" "$@"; }
old=$(dc ps -q sidecar | head -n 1)
if [ "$BUILD" = 1 ]; then dc build sidecar; fi
dc up -d --no-build --no-deps --no-recreate --scale sidecar=2 sidecar
for i in $(seq 1 60); do
  if [ -z "$old" ] || [ "$(docker inspect -f '{{.State.Running}}' "$old" 2>/dev/null)" != "true" ]; then
    # Remove the old container by id rather than `--scale sidecar=1`: which container compose
    # removes when scaling down is its choice, and it must not be the new one.
    if [ -n "$old" ]; then
      code=$(docker inspect -f '{{.State.ExitCode}}' "$old")
      [ "$code" = 0 ] || { echo "the old sidecar exited $code instead of handing over; see: docker logs $old" >&2; exit 1; }
      docker rm "$old" >/dev/null
    fi
    new=$(dc ps -q sidecar | head -n 1)
    docker exec "$new" omni-sidecar status --timeout 3 >/dev/null
    echo "sidecar upgraded by takeover; vLLM kept running"
    exit 0
  fi
  sleep 1
done
echo "the old sidecar did not hand over within 60 s; see: docker compose -f $FILE logs sidecar" >&2
exit 1
