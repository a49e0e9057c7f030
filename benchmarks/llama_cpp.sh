#!/usr/bin/env bash
# Build llama.cpp (the deepseek4 architecture) as the peer and second reference of moepack's GGUF export: the
# llama.cpp that llama-cpp-python 0.3.36's source distribution on PyPI vendors (vendor/llama.cpp), CPU only, with
# its command-line tools. About 8 minutes on 2 cores.
#
#   bash benchmarks/llama_cpp.sh [DIR]      (default: ~/.cache/moepack/llama.cpp)
#   export MOEPACK_LLAMA_CPP=DIR/build      (what the tests and benchmarks look for: bin/llama-bench, bin/llama-simple, bin/llama-logits)
#
# LLAMA_CUDA=ARCH (e.g. 90 for an H200) builds llama-bench with CUDA instead, in DIR/build-cuda, for a GPU machine
# that may be another one (benchmarks/device_check.sh carries it there): CUDA's compiler and cuBLAS's headers and
# libraries are needed here, not a GPU; generic x86-64 code (AVX2), no NCCL, no CUDA driver library at link time
# (ggml's VMM pool off). About 30 minutes on 2 cores.
set -euo pipefail
DIR=${1:-${XDG_CACHE_HOME:-$HOME/.cache}/moepack/llama.cpp}
VERSION=0.3.36
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
mkdir -p "$DIR"
cd "$DIR"
DIR=$(pwd)
if [ ! -d src/vendor/llama.cpp ]; then
    python3 -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d sdist
    mkdir -p src
    tar -xzf "sdist/llama_cpp_python-$VERSION.tar.gz" -C src --strip-components=1
fi
if [ -n "${LLAMA_CUDA:-}" ]; then
    cmake -S src/vendor/llama.cpp -B build-cuda -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=OFF -DGGML_AVX=ON \
        -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_CUDA=ON -DGGML_CUDA_NO_VMM=ON -DGGML_CUDA_NCCL=OFF \
        -DCMAKE_CUDA_ARCHITECTURES="$LLAMA_CUDA" -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF \
        -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF > build-cuda.log
    cmake --build build-cuda -j "$(nproc)" --target llama-bench >> build-cuda.log
    echo "built: $DIR/build-cuda/bin ($(ls build-cuda/bin | tr '\n' ' '))"
    exit 0
fi
cmake -S src/vendor/llama.cpp -B build -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
    -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=ON -DLLAMA_BUILD_SERVER=OFF > build.log
# only what the tests and benchmarks run: the whole tree links an app against the server this build leaves out
cmake --build build -j "$(nproc)" --target llama-bench llama-simple >> build.log
# the logits dumper the tests and benchmarks compare moepack with (benchmarks/llama_logits/llama_logits.cpp)
LL=src/vendor/llama.cpp
c++ -O2 -std=c++17 "$HERE/llama_logits/llama_logits.cpp" -I "$LL/include" -I "$LL/ggml/include" -L build/bin \
    -lllama -lggml -Wl,-rpath,"$DIR/build/bin" -o build/bin/llama-logits
echo "built: $DIR/build/bin ($(ls build/bin | tr '\n' ' '))"
echo "export MOEPACK_LLAMA_CPP=$DIR/build"
