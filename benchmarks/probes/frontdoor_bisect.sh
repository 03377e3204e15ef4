#!/bin/bash
# bench frontdoor's 1,000-stream figure for several checkouts, alternating, two rounds (run it under
# flock /tmp/pdserve-bench.lock): which commit moved the p99, and which part of the slowest 1% did.
# usage: benchmarks/probes/frontdoor_bisect.sh OUT_DIR CHECKOUT...
set -u
out=$1; shift; mkdir -p "$out"
F="--clients 200 --latency-streams 1000 --latency-requests 1500 --json"
for round in 1 2; do
  i=0
  for dir in "$@"; do
    i=$((i + 1))
    echo "== checkout $i ($dir) round $round $(date -u +%T) load $(cut -d' ' -f1 /proc/loadavg)"
    # shellcheck disable=SC2086
    (cd "$dir" && PYTHONPATH=$dir timeout 300 python -m services.cli bench frontdoor $F > "$out/$i-$round.json" 2> "$out/$i-$round.log")
    python3 -c "import json, sys; L = json.load(open(sys.argv[1]))['latency']; print('   p99', round(L['added_ms_p99'], 1), 'slowest 1%', L.get('probe', {}).get('slowest_1pct', {}).get('mean_ms'))" "$out/$i-$round.json"
  done
done
