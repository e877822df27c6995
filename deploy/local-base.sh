#!/bin/sh
# Makes a Python 3.11 base image on this host from Debian packages alone, for hosts that reach
# a Debian mirror and a package index but no image registry (so no python:3.11-slim to pull):
#   deploy/local-base.sh [IMAGE]      (default omni-sidecar/python-base:3.11-bookworm)
# Then build the images on top of it (README, "Building without an image registry"):
#   docker build --build-arg BASE=IMAGE ...       (deploy/Dockerfile.sidecar)
#   docker build --build-arg CPU_BASE=IMAGE ...   (deploy/Dockerfile.vllm, target cpu)
# Reuses IMAGE when it exists (FORCE=1 makes it again). Needs root, debootstrap and a running dockerd.
# MIRROR (default: the Debian source apt already uses here) picks where packages come from.
set -eu
IMAGE=${1:-omni-sidecar/python-base:3.11-bookworm}
# bookworm's python3 is 3.11, the version the project's images and wheels are made for.
SUITE=bookworm

if [ -z "${FORCE:-}" ] && docker image inspect "$IMAGE" >/dev/null 2>&1; then
  echo "local-base: reusing $IMAGE"
  exit 0
fi
command -v debootstrap >/dev/null || { echo "local-base: needs debootstrap (apt-get install debootstrap)" >&2; exit 1; }

# The mirror apt already uses (deb822 .sources first, then one-line .list entries), not a
# hard-coded one: hosts without registry access often reach only their own mirror or proxy.
apt_mirror() {
  { grep -h '^URIs:' /etc/apt/sources.list.d/*.sources 2>/dev/null | awk '{print $2}'
    grep -h '^deb ' /etc/apt/sources.list /etc/apt/sources.list.d/*.list 2>/dev/null \
      | sed 's/\[[^]]*\] *//' | awk '{print $2}'
  } | grep -v -- '-security' | head -n 1
}
MIRROR=${MIRROR:-$(apt_mirror)}
[ -n "$MIRROR" ] || MIRROR=http://deb.debian.org/debian

ROOT=$(mktemp -d /var/tmp/omni-base.XXXXXX)
trap 'rm -rf "$ROOT"' EXIT INT TERM
echo "local-base: debootstrap $SUITE from $MIRROR"
debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
  "$SUITE" "$ROOT" "$MIRROR" >"$ROOT.log" 2>&1 || { tail -n 30 "$ROOT.log" >&2; rm -f "$ROOT.log"; exit 1; }
rm -f "$ROOT.log"

# Trust what this host trusts: builds on top of this base reach the package index through the
# host's network, which may re-sign TLS with a CA of its own (a proxy). This base is local to
# this host and is never pushed; the public defaults (python:3.11-slim) are untouched.
cp /etc/ssl/certs/ca-certificates.crt "$ROOT/etc/ssl/certs/ca-certificates.crt"

# Debian marks its Python externally managed (PEP 668: pip refuses to install into it), so the
# Dockerfiles' `pip install` runs in a venv that is first on PATH, as python:3.11-slim's is.
chroot "$ROOT" /usr/bin/python3 -m venv /opt/venv
rm -rf "$ROOT"/var/cache/apt/archives/*.deb "$ROOT"/var/lib/apt/lists/* "$ROOT"/var/log/*.log

tar -C "$ROOT" --numeric-owner -c . | docker import \
  -c 'ENV PATH=/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
  -c 'ENV LANG=C.UTF-8' -c 'CMD ["python3"]' \
  -m "debootstrap $SUITE from $MIRROR + /opt/venv (deploy/local-base.sh)" - "$IMAGE" >/dev/null
echo "local-base: made $IMAGE ($(docker image inspect -f '{{.Size}}' "$IMAGE" | awk '{printf "%.0f MB", $1/1e6}'))"
