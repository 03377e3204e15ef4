#!/usr/bin/env bash
# The external tools of the deployment checks (tests/deploy): promtool (Debian's prometheus package),
# kubectl (for `kubectl kustomize`), docker-compose (Debian's, 1.29). The Python ones come with
# `pip install -e .[test]`. Idempotent; needs root for apt-get. What cannot be installed is named, and
# its checks skip loudly (CI sets PDSERVE_REQUIRE_DEPLOY_TOOLS=1, which makes them fail instead).
set -uo pipefail
missing=()
command -v promtool >/dev/null || missing+=(prometheus)
command -v docker-compose >/dev/null || missing+=(docker-compose)
# Debian's kubernetes-client is kubectl 1.20, whose kustomize predates the fields deploy/k8s uses:
# only a kubectl that can render the overlays counts.
if ! kubectl kustomize "$(dirname "$0")/../deploy/k8s/overlays/cpu" >/dev/null 2>&1; then
  echo "[deploy-tools] kubectl with kustomize v5 is missing: install kubectl from the Kubernetes project" >&2
fi
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" -ne 0 ]; then
    echo "[deploy-tools] not root: cannot install ${missing[*]}" >&2
    exit 1
  fi
  echo "[deploy-tools] apt-get install ${missing[*]}"
  apt_locked() { DEBIAN_FRONTEND=noninteractive flock /tmp/pdserve-apt.lock apt-get "$@"; }  # one apt at a time (.ci/run builds images meanwhile)
  { apt_locked install -y -q --no-install-recommends "${missing[@]}" \
      || { apt_locked update -q && apt_locked install -y -q --no-install-recommends \
           "${missing[@]}"; }; } >/dev/null || exit 1
fi
echo "[deploy-tools] promtool $(promtool --version 2>&1 | head -1 | awk '{print $3}'), docker-compose $(docker-compose version --short 2>/dev/null)"
