#!/usr/bin/env bash
# Builds llama.cpp's llama-server from the llama.cpp source that the llama-cpp-python sdist vendors
# (the same llama.cpp the engine bench compares against), as one self-contained binary, and caches
# it outside the repo: ${PDSERVE_LLAMA_SERVER_DIR:-~/.cache/pdserve/llama-server}/<version>-<flavour>/llama-server.
# `pdserve bench peer` finds it there. Takes about 6 minutes of two cores. Idempotent: an existing
# binary is kept. Needs cmake, a C++ compiler and pip (to fetch the sdist from PyPI).
#
# Flavours (LLAMA_SERVER_FLAVOUR): native (default) is llama.cpp's own default build for this CPU
# (GGML_NATIVE). On a CPU with AMX, that build's AMX weight repacking crashes at model load
# (ggml-org/llama.cpp#20824); `pdserve bench peer` then runs it with --no-repack. noamx builds every
# AVX-512 extension but not AMX, which keeps llama.cpp's other repacked (AVX-512) weights.
set -euo pipefail
version="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
flavour="${LLAMA_SERVER_FLAVOUR:-native}"
case "$flavour" in
  native) cpu_flags=(-DGGML_NATIVE=ON) ;;
  noamx) cpu_flags=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=ON
                    -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AMX_TILE=OFF
                    -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF) ;;
  *) echo "[llama-server] LLAMA_SERVER_FLAVOUR must be native or noamx" >&2; exit 2 ;;
esac
jobs="${JOBS:-$(nproc)}"
root="${PDSERVE_LLAMA_SERVER_DIR:-$HOME/.cache/pdserve/llama-server}"
dest="$root/$version-$flavour"
if [ -x "$dest/llama-server" ]; then
  echo "[llama-server] already built: $dest/llama-server"
  exit 0
fi
for tool in cmake c++ pip; do
  command -v "$tool" >/dev/null || { echo "[llama-server] $tool is missing (apt-get install cmake g++)" >&2; exit 1; }
done
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
echo "[llama-server] fetching the llama-cpp-python $version sdist"
pip download --quiet --no-deps --no-binary :all: --dest "$work" "llama-cpp-python==$version"
tar -xzf "$work"/llama_cpp_python-"$version".tar.gz -C "$work"
src="$work/llama_cpp_python-$version/vendor/llama.cpp"
[ -f "$src/CMakeLists.txt" ] || { echo "[llama-server] no vendored llama.cpp in the sdist" >&2; exit 1; }
echo "[llama-server] configuring (static, $flavour CPU flags, server only)"
cmake -S "$src" -B "$work/build" -DCMAKE_BUILD_TYPE=Release -DLLAMA_BUILD_SERVER=ON \
  -DBUILD_SHARED_LIBS=OFF -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
  "${cpu_flags[@]}" >"$work/configure.log" 2>&1 || { tail -30 "$work/configure.log" >&2; exit 1; }
echo "[llama-server] building with $jobs jobs (about 6 minutes on 2 cores)"
cmake --build "$work/build" --target llama-server -j "$jobs" >"$work/build.log" 2>&1 \
  || { tail -30 "$work/build.log" >&2; exit 1; }
mkdir -p "$dest"
cp "$work/build/bin/llama-server" "$dest/llama-server.tmp"
mv "$dest/llama-server.tmp" "$dest/llama-server"
echo "[llama-server] built: $dest/llama-server ($("$dest/llama-server" --version 2>&1 | head -1))"
