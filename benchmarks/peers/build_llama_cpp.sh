#!/usr/bin/env bash
# Builds llama.cpp's C++ programs for `specdec bench --peers` (llama-completion,
# llama-speculative-simple, llama-bench) from the llama.cpp that llama-cpp-python's source package
# vendors: only the package registry is needed. Usage: build_llama_cpp.sh PYTHON
# PYTHON is specdec's venv python: it names the version and the folder (specdec.bench.llama_cpp).
# The programs are linked statically and land in the folder's bin/ only once all are built.
# ggml is built for this CPU (GGML_NATIVE) but without AMX: on a Xeon with AMX its AMX path dies
# with SIGILL (it never asks Linux for the tile state); explicit -mno-amx-* outrank -march=native.
set -euo pipefail
python=$1
{ read -r version; read -r bin; } < <("$python" -c "from specdec.bench import llama_cpp; print(llama_cpp.VERSION); print(llama_cpp.tools_dir())")
home=$(dirname "$bin")
programs="llama-completion llama-speculative-simple llama-bench"
if [ -x "$bin/llama-completion" ] && [ -x "$bin/llama-speculative-simple" ] && [ -x "$bin/llama-bench" ]; then
    echo "llama.cpp $version's programs are built: $bin"; exit 0
fi
mkdir -p "$home"
src="$home/src"
if [ ! -f "$src/CMakeLists.txt" ]; then
    download=$(mktemp -d)
    trap 'rm -rf "$download"' EXIT
    # The sdist's metadata needs its build backend: installed here rather than in an isolated env.
    "$python" -m pip install -q scikit-build-core
    "$python" -m pip download -q --no-deps --no-binary :all: --no-build-isolation "llama-cpp-python==$version" -d "$download"
    tar xzf "$download"/llama_cpp_python-*.tar.gz -C "$download"
    rm -rf "$src" && mv "$download"/llama_cpp_python-*/vendor/llama.cpp "$src"
    rm -f "$src/.git"  # a submodule's pointer into the package's own repository, not shipped
fi
no_amx="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
cmake -S "$src" -B "$home/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
    -DBUILD_SHARED_LIBS=OFF -DCMAKE_C_FLAGS="$no_amx" -DCMAKE_CXX_FLAGS="$no_amx" > "$home/cmake.log"
echo "building llama.cpp $version's $programs (a few minutes; log: $home/build.log)"
cmake --build "$home/build" -j "$(nproc)" --target $programs > "$home/build.log"
mkdir -p "$bin.tmp"
for p in $programs; do cp "$home/build/bin/$p" "$bin.tmp/"; done
rm -rf "$bin" && mv "$bin.tmp" "$bin"
echo "llama.cpp $version's programs: $bin"
