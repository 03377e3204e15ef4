#!/usr/bin/env bash
# KV transfer between two containers of the pdserve image, by how much they share: the measurement
# behind compose.yaml's choice of IPC/PID namespaces (deploy/README.md, BENCHMARKS.md).
#
#   separate   own IPC and PID namespaces (compose's default): UCX can only use TCP between them
#   ipc        the sender joins the receiver's IPC namespace (ipc: service:...): SysV/POSIX shared memory
#   ipc+pid    and its PID namespace too (pid: service:...): UCX's cma single copy becomes possible
#   one        both sides in one container (the bench's spawned child): the upper bound
#
# `pdserve bench kvtransfer --serve-peer` runs in one container, `--peer` in another, on one docker
# network; the configurations take turns, ROUNDS times, so drift hits them alike. Results (the bench's
# --save JSON) go to benchmarks/results/, one file per run, named after its configuration.
# Usage: [CONFIGS="ipc+pid one"] scripts/container-kvtransfer.sh [IMAGE] [ROUNDS]
# (run it under flock /tmp/pdserve-bench.lock)
set -euo pipefail
cd "$(dirname "$0")/.."
IMAGE=${1:-pdserve:cpu}
ROUNDS=${2:-2}
TOKENS=${TOKENS:-1024,8192}
REPEATS=${REPEATS:-5}
NET=pdserve-kvbench
OUT=$(mktemp -d /tmp/pdserve-kvbench.XXXXXX)
chmod 777 "$OUT"  # the image runs as uid 10001
mkdir -p benchmarks/results
cleanup() {
  docker rm -f kvrx kvns >/dev/null 2>&1 || true
  docker network rm "$NET" >/dev/null 2>&1 || true
  rm -rf "$OUT"
}
trap cleanup EXIT
docker network create "$NET" >/dev/null 2>&1 || true
docker rm -f kvns >/dev/null 2>&1 || true
docker run -d --name kvns --network "$NET" --ipc shareable --shm-size 1g --entrypoint sleep "$IMAGE" infinity >/dev/null
bench=(bench kvtransfer --tokens "$TOKENS" --repeats "$REPEATS" --json --save /out)

run() {  # run CONFIG: one measurement, its JSON moved to benchmarks/results/kvtransfer-container-CONFIG-*.json
  local config=$1 share=()
  # Shared namespaces belong to a third container (as compose's would): had the receiver owned the PID
  # namespace, its exit would SIGKILL the sender before it saved its result.
  case $config in
    separate) ;;
    ipc) share=(--ipc container:kvns) ;;
    ipc+pid) share=(--ipc container:kvns --pid container:kvns) ;;
  esac
  if [ "$config" = one ]; then
    docker run --rm --network "$NET" --shm-size 1g -v "$OUT:/out" "$IMAGE" "${bench[@]}" >/dev/null
  else
    docker rm -f kvrx >/dev/null 2>&1 || true
    docker run -d --name kvrx --network "$NET" "${share[@]}" "$IMAGE" \
      bench kvtransfer --serve-peer 0.0.0.0:47000 >/dev/null
    local ip
    ip=$(docker inspect -f '{{range .NetworkSettings.Networks}}{{.IPAddress}}{{end}}' kvrx)
    for _ in $(seq 60); do docker logs kvrx 2>&1 | grep -q "waiting for a --peer" && break; sleep 1; done
    docker run --rm --network "$NET" "${share[@]}" -v "$OUT:/out" "$IMAGE" "${bench[@]}" --peer "$ip:47000" >/dev/null
    docker wait kvrx >/dev/null
  fi
  local file
  file=$(ls -t "$OUT"/kvtransfer-*.json | head -1)
  mv "$file" "benchmarks/results/kvtransfer-container-${config/+/-}-$(basename "$file" .json | cut -d- -f2-).json"
  python3 - "benchmarks/results/kvtransfer-container-${config/+/-}-$(basename "$file" .json | cut -d- -f2-).json" "$config" "$IMAGE" <<'EOF'
import json, subprocess, sys
doc = json.load(open(sys.argv[1]))
if not doc.get("commit"):  # the image holds no git checkout: name the host tree it was run from, and the image
    head = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True).stdout.strip()
    doc["commit"] = head or None
    doc["image"] = sys.argv[3]
    json.dump(doc, open(sys.argv[1], "w"), indent=1)
sizes = doc["result"]["sizes"]
cells = "  ".join(f"{k}: ucx {v.get('ucx_gbps', float('nan')):.2f} tcp {v.get('tcp_gbps', float('nan')):.2f} "
                  f"raw {v.get('raw_gbps', float('nan')):.2f}" for k, v in sizes.items())
print(f"[container-kvtransfer] {sys.argv[2]:>8}: {cells} GB/s  (load {doc['result']['loadavg_1m']}, verified "
      f"{doc['result']['verified']})", flush=True)
EOF
}

echo "[container-kvtransfer] $IMAGE, tokens $TOKENS, $REPEATS repeats, $ROUNDS rounds; load: $(cut -d' ' -f1-3 /proc/loadavg)"
for round in $(seq "$ROUNDS"); do
  for config in ${CONFIGS:-separate ipc ipc+pid one}; do
    run "$config"
  done
done
