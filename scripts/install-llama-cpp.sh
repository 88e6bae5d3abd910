#!/usr/bin/env bash
# Installs llama-cpp-python (llama.cpp, the peer of `quire bench compare --peer llama.cpp`) into
# its own venv, built from source:
#   scripts/install-llama-cpp.sh [VENV_DIR]    (default: $QUIRE_CACHE_DIR/llama-cpp)
# Version: LLAMA_CPP_PYTHON_VERSION (0.3.36). About 3 minutes on 2 idle cores (more when busy).
# The build names the instruction sets it uses instead of -march=native (GGML_NATIVE=OFF): the
# ones this CPU has, read from /proc/cpuinfo, so the library is the one llama.cpp picks for this
# CPU and the comparison's JSON can say which (`llama_print_system_info`), while a venv on a
# shared disk still runs on an older CPU that has those flags. CMAKE_ARGS, when set, wins; pip's
# wheel cache is bypassed, since it would hand back a wheel built with other arguments.
set -euo pipefail
cache="${QUIRE_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/quire}"
venv="${1:-$cache/llama-cpp}"
python="${PYTHON:-python3}"
version="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"

if [ -x "$venv/bin/python" ] && "$venv/bin/python" -c "import llama_cpp" 2>/dev/null; then
    echo "llama-cpp-python is already installed in $venv"
    exit 0
fi
flags=" $(grep -m1 '^flags' /proc/cpuinfo | cut -d: -f2) "
has() { [[ "$flags" == *" $1 "* ]] && echo ON || echo OFF; }
args="-DGGML_NATIVE=OFF -DGGML_AVX=$(has avx) -DGGML_AVX2=$(has avx2) -DGGML_FMA=$(has fma)"
args+=" -DGGML_F16C=$(has f16c) -DGGML_BMI2=$(has bmi2) -DGGML_AVX512=$(has avx512f)"
args+=" -DGGML_AVX512_VNNI=$(has avx512_vnni) -DGGML_AVX512_BF16=$(has avx512_bf16)"
args+=" -DGGML_AVX512_VBMI=$(has avx512vbmi) -DGGML_AVX_VNNI=$(has avx_vnni)"
# llama.cpp's AMX tile kernels (GGML_AMX_TILE/INT8/BF16) stay off: built with them on a 2-core
# Xeon with AMX (family 6, model 207; 2026-11-28), the first prompt died with SIGILL on a
# tileloadd in ggml_backend_amx_mul_mat (an OpenMP worker thread), while oneDNN's AMX matmuls
# ran in Quire's process on the same machine.
args+=" -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
args+=" -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF"
args+=" -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF"
"$python" -m venv "$venv"
echo "building llama-cpp-python $version with CMAKE_ARGS=${CMAKE_ARGS:-$args}"
CMAKE_ARGS="${CMAKE_ARGS:-$args}" CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}" \
    "$venv/bin/pip" install -q --no-cache-dir "llama-cpp-python==$version"
"$venv/bin/python" -c "import llama_cpp; print('llama-cpp-python', llama_cpp.__version__, 'installed in $venv')"
