#!/bin/bash
# Paired `pdserve bench hops` runs: BASE (a checkout of the commit before a change) and MINE (this
# checkout), alternating base, mine, mine, base so that drift cancels; raw JSON into OUT.
# usage: benchmarks/probes/hops_ab.sh BASE_DIR OUT_DIR   (run it under flock /tmp/pdserve-bench.lock)
set -eu
base=$(cd "$1" && pwd); mine=$(cd "$(dirname "$0")/../.." && pwd); out=$2; mkdir -p "$out"
for side in base mine mine base; do
  dir=$base; [ "$side" = mine ] && dir=$mine
  echo "== $side start $(date -u +%T) load $(cut -d' ' -f1 /proc/loadavg)"
  (cd "$dir" && PYTHONPATH=$dir timeout 400 python -m services.cli bench hops --concurrency 1,16 --requests 32 \
     --quantization gguf --threads 2 --batch1-rounds 3 --router-arg=--local-prefill-max-tokens=256 --json) \
     > "$out/ab-$side-$(date +%H%M%S).json"
done
