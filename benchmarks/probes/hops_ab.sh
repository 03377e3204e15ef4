#!/bin/bash
# Paired `pdserve bench hops` runs: BASE (a checkout of the commit before a change) and MINE (this
# checkout), alternating base, mine, mine, base so that drift cancels; raw JSON into OUT.
# usage: benchmarks/probes/hops_ab.sh BASE_DIR OUT_DIR   (run it under flock /tmp/pdserve-bench.lock)
# BASE_ENV / MINE_ENV: variables for one side only (e.g. MINE_ENV=GOMP_SPINCOUNT=3000 with BASE_DIR this
# checkout compares two settings of one commit); BASE_ARGS / MINE_ARGS: bench flags for one side only (e.g.
# MINE_ARGS=--worker-arg=--loop=asyncio); HOPS_ARGS replaces the arguments both sides get (below).
set -eu
base=$(cd "$1" && pwd); mine=$(cd "$(dirname "$0")/../.." && pwd); out=$2; mkdir -p "$out"
args=${HOPS_ARGS:-"--concurrency 1,16 --requests 32 --quantization gguf --threads 2 --batch1-rounds 3 --router-arg=--local-prefill-max-tokens=256"}
for side in base mine mine base; do
  dir=$base; envs=${BASE_ENV:-}; extra=${BASE_ARGS:-}
  [ "$side" = mine ] && { dir=$mine; envs=${MINE_ENV:-}; extra=${MINE_ARGS:-}; }
  echo "== $side start $(date -u +%T) load $(cut -d' ' -f1 /proc/loadavg) ${envs} ${extra}"
  # shellcheck disable=SC2086  # the arguments and variables are word lists
  (cd "$dir" && env PYTHONPATH="$dir" $envs timeout 400 python -m services.cli bench hops $args $extra --json) \
     > "$out/ab-$side-$(date +%H%M%S).json"
done
