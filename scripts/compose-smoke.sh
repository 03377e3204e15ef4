#!/usr/bin/env bash
# The compose stack for real, on a machine with no image registry (CI runs it from .ci/run):
#
#   1. installs docker.io, docker-compose and debootstrap if missing, starts dockerd if none runs;
#   2. builds a Debian bookworm base image with debootstrap + docker import (once: kept in docker's
#      image store as pdserve-base:bookworm), and Redis on it from Debian's redis-server package
#      (pdserve-redis:7), since redis:7.4 cannot be pulled;
#   3. builds the pdserve CPU image from deploy/docker/Dockerfile on that base, with the local torch
#      CPU wheel (pip's find-links directory) and this host's CA bundle as build inputs;
#   4. `docker-compose up` of compose.yaml, then scripts/compose_smoke.py: a streaming chat completion
#      with the openai client, decode scaled to 2, one decode container SIGKILLed while requests stream
#      (every request must end, with tokens or a clear error), the container restarted;
#   5. tears everything down (containers, network, volumes; dockerd if this script started it).
#
# Needs root (apt-get, dockerd). Environment: PDSERVE_SMOKE_KEEP=1 leaves the stack up for a look.
# `compose-smoke.sh --build-only` does 1-3 and stops (.ci/run builds the images while the test suite runs;
# the full run after it finds them in docker's cache).
set -euo pipefail
build_only=""
[ "${1:-}" = "--build-only" ] && build_only=1
cd "$(dirname "$0")/.."
started=$(date +%s)
PROJECT=pdserve-smoke
BASE_IMAGE=pdserve-base:bookworm
REDIS_IMAGE=pdserve-redis:7
IMAGE=pdserve:cpu
WORK=$(mktemp -d /tmp/pdserve-smoke.XXXXXX)
DOCKERD_PID=""
step() { echo "[compose-smoke] $(( $(date +%s) - started ))s: $*"; }

cleanup() {
  local rc=$?
  if [ -z "${PDSERVE_SMOKE_KEEP:-}" ] && command -v docker-compose >/dev/null && docker info >/dev/null 2>&1; then
    if [ "$rc" -ne 0 ]; then
      step "failed; the stack's last log lines:"
      compose logs --no-color --tail=40 2>&1 | tail -150 || true
    fi
    compose down -v --remove-orphans >/dev/null 2>&1 || true
  fi
  if [ -n "$DOCKERD_PID" ] && [ -z "${PDSERVE_SMOKE_KEEP:-}" ]; then
    kill "$DOCKERD_PID" 2>/dev/null && wait "$DOCKERD_PID" 2>/dev/null || true
  fi
  rm -rf "$WORK"
  step "done (exit $rc)"
}
trap cleanup EXIT

# compose.yaml's variables for this run (exported: compose_smoke.py calls docker-compose too): the images
# built here, ephemeral host ports (other stacks may hold 8000), small KV caches, one thread per worker
export PDSERVE_IMAGE=$IMAGE REDIS_IMAGE=$REDIS_IMAGE PDSERVE_HTTP_PORT=127.0.0.1:0 \
  PDSERVE_ROUTER_GRPC_PORT=127.0.0.1:0 PDSERVE_KV_CACHE_GB=0.25 PDSERVE_THREADS=1
compose() { docker-compose -p "$PROJECT" -f compose.yaml "$@"; }

# ---- 1. tools and the daemon -------------------------------------------------------------------
need=()
command -v dockerd >/dev/null || need+=(docker.io)
command -v docker-compose >/dev/null || need+=(docker-compose)
command -v debootstrap >/dev/null || need+=(debootstrap)
if [ ${#need[@]} -gt 0 ]; then
  step "apt-get install ${need[*]}"
  export DEBIAN_FRONTEND=noninteractive
  # one apt at a time (.ci/run builds while scripts/test.sh installs its tools)
  apt_locked() { DEBIAN_FRONTEND=noninteractive flock /tmp/pdserve-apt.lock apt-get "$@"; }
  apt_locked install -y -q "${need[@]}" >/dev/null 2>&1 || { apt_locked update -q >/dev/null && apt_locked install -y -q "${need[@]}" >/dev/null; }
fi
if ! docker info >/dev/null 2>&1; then
  step "starting dockerd"
  dockerd >"$WORK/dockerd.log" 2>&1 &
  DOCKERD_PID=$!
  for _ in $(seq 60); do docker info >/dev/null 2>&1 && break; sleep 1; done
  docker info >/dev/null 2>&1 || { cat "$WORK/dockerd.log"; exit 1; }
fi
compose down -v --remove-orphans >/dev/null 2>&1 || true  # a previous run's leftovers

# ---- 2. base and Redis images, without a registry ----------------------------------------------
if ! docker image inspect "$BASE_IMAGE" >/dev/null 2>&1; then
  # the Debian mirror apt itself uses (sources.list may not exist: grep's status 2 must not end the script)
  mirror=$({ grep -rhoE '^(URIs:|deb) +https?://[^ ]+/debian/?' /etc/apt/sources.list /etc/apt/sources.list.d/ 2>/dev/null \
           || true; } | grep -v security | head -1 | awk '{print $2}')
  mirror=${mirror:-http://deb.debian.org/debian}
  step "debootstrap bookworm from $mirror (once; cached as $BASE_IMAGE)"
  debootstrap --variant=minbase --include=python3,python3-venv,python3-pip,ca-certificates \
    bookworm "$WORK/rootfs" "$mirror" >"$WORK/debootstrap.log" 2>&1 || { tail -20 "$WORK/debootstrap.log"; exit 1; }
  tar -C "$WORK/rootfs" -c . | docker import - "$BASE_IMAGE" >/dev/null
  rm -rf "$WORK/rootfs"
fi
if ! docker image inspect "$REDIS_IMAGE" >/dev/null 2>&1; then
  step "building $REDIS_IMAGE (Debian's redis-server)"
  docker build -q --build-arg BASE_IMAGE="$BASE_IMAGE" -t "$REDIS_IMAGE" - <deploy/docker/redis.Dockerfile >/dev/null
fi

# ---- 3. the pdserve image ----------------------------------------------------------------------
torch_version=$(python3 -c "import torch; print(torch.__version__)" 2>/dev/null || echo "")
rm -f deploy/docker/wheels/torch-*.whl
for dir in $(python3 -m pip config list 2>/dev/null | grep -oE "find-links='[^']+'" | cut -d"'" -f2 | tr ' ' '\n' | sort -u); do
  for wheel in "$dir"/torch-"${torch_version:-*}"-cp3*-linux_x86_64.whl "$dir"/torch-"${torch_version:-*}"-cp3*-manylinux*_x86_64.whl; do
    [ -f "$wheel" ] && cp "$wheel" deploy/docker/wheels/ && break 2
  done
done
ls deploy/docker/wheels/torch-*.whl >/dev/null 2>&1 || step "no local torch wheel: the build downloads torch from PyTorch's CPU index"
[ -f /etc/ssl/certs/ca-certificates.crt ] && cp /etc/ssl/certs/ca-certificates.crt deploy/docker/ca/host-bundle.crt
step "building $IMAGE on $BASE_IMAGE"
# PDSERVE_SMOKE_BUILD_ARGS: extra `docker build` arguments, e.g. "--cpu-shares 2" to build only on idle CPU
# shellcheck disable=SC2086
docker build ${PDSERVE_SMOKE_BUILD_ARGS:-} -f deploy/docker/Dockerfile --build-arg BASE_IMAGE="$BASE_IMAGE" -t "$IMAGE" . \
  >"$WORK/build.log" 2>&1 \
  || { tail -40 "$WORK/build.log"; exit 1; }
docker image inspect "$IMAGE" --format '[compose-smoke] image {{.Id}}: {{.Size}} bytes, user {{.Config.User}}'
# the final stage has no compiler, yet the C kernels are there for this CPU
docker run --rm --entrypoint python "$IMAGE" -c \
  "import shutil; from kernels import native; assert shutil.which('gcc') is None and shutil.which('cc') is None; \
lib = native.library(); assert lib is not None, 'no prebuilt kernels'; print('[compose-smoke] no compiler; kernels:', lib._name)"

[ -n "$build_only" ] && { step "images built"; exit 0; }

# ---- 4. the stack -------------------------------------------------------------------------------
step "docker-compose up"
compose up -d
python3 scripts/compose_smoke.py -p "$PROJECT" -f compose.yaml
step "passed"
