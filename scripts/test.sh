#!/usr/bin/env bash
# The README's test command: installs everything (idempotent), then runs the whole suite.
# pytest's exit code 5 (no tests collected) is a broken setup, not a pass.
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh || exit 1
# promtool, docker-compose, kubectl for tests/deploy (without them those checks skip, loudly)
bash scripts/install-deploy-tools.sh || echo "[test] some deployment tools are missing: their checks will skip" >&2
PY=${PYTHON:-python3}
"$PY" -m pytest -q -p no:cacheprovider "$@"
rc=$?
if [ "$rc" -eq 5 ]; then
  echo "error: pytest collected no tests; the test setup is broken" >&2
  exit 1
fi
exit "$rc"
