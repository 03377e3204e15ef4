#!/usr/bin/env bash
# The README's test command: installs everything (idempotent), then runs the whole suite.
# pytest's exit code 5 (no tests collected) is a broken setup, not a pass.
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh || exit 1
# promtool, docker-compose, kubectl for tests/deploy (without them those checks skip, loudly)
bash scripts/install-deploy-tools.sh || echo "[test] some deployment tools are missing: their checks will skip" >&2
PY=${PYTHON:-python3}
# Two test processes (pytest-xdist), each taking a whole test file at a time, so a file's module
# fixtures (a started stack) are built once; each process has its own Redis-compatible server.
# Much of a stack test is waiting on other processes, so two cut the suite's wall time on 2 cores
# by about a quarter. PDSERVE_TEST_WORKERS=0 runs it in this one process; another count, that many.
workers=${PDSERVE_TEST_WORKERS:-2}
parallel=()
if [ "$workers" != "0" ]; then
  parallel=(-n "$workers" --dist loadfile)
fi
"$PY" -m pytest -q -p no:cacheprovider "${parallel[@]}" "$@"
rc=$?
if [ "$rc" -eq 5 ]; then
  echo "error: pytest collected no tests; the test setup is broken" >&2
  exit 1
fi
exit "$rc"
