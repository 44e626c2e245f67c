#!/usr/bin/env bash
# Builds scripts/llamacpp_dump/dump.cpp against the llama.cpp vendored by llama-cpp-python
# 0.3.36 (the version scripts/record_llamacpp.py records with), configured as its wheel is on
# x86-64 (native ISA, OpenMP, llamafile sgemm and repacking on).
#
#   pip download llama-cpp-python==0.3.36 --no-deps --no-binary llama-cpp-python -d /tmp/ll
#   tar xzf /tmp/ll/llama_cpp_python-0.3.36.tar.gz -C /tmp/ll
#   scripts/llamacpp_dump/build.sh /tmp/ll/llama_cpp_python-0.3.36/vendor/llama.cpp
#   /tmp/ll/.../build/bin/llamacpp-dump models/SmolLM2-135M-Instruct.Q4_1.gguf /tmp/dump 1,504,3575 2
#
# Needs cmake (pip install cmake ninja) and a C++17 compiler.
set -euo pipefail
src=${1:?usage: build.sh LLAMA_CPP_DIR}
here=$(cd "$(dirname "$0")" && pwd)
build="$src/build"
if [ ! -f "$build/bin/libllama.so" ]; then
    cmake -S "$src" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
        -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_TOOLS=OFF \
        -DLLAMA_BUILD_EXAMPLES=OFF -DBUILD_SHARED_LIBS=ON
    ninja -C "$build" -j"$(nproc)" llama
fi
g++ -O2 -std=c++17 "$here/dump.cpp" -o "$build/bin/llamacpp-dump" \
    -I"$src/include" -I"$src/ggml/include" -L"$build/bin" -lllama -lggml -lggml-base \
    -Wl,-rpath,"$build/bin"
echo "$build/bin/llamacpp-dump"
