#!/usr/bin/env bash
# Makes worker/tests/data/llamacpp: the tiny models of the new families as
# llama.cpp's own converter writes them (f32, so every golden case must
# come out exact), and gpt-oss with MXFP4 experts from llama.cpp's own
# quantizer. Not part of CI (it needs torch and a llama.cpp build); the
# files are committed.
#
#   python3 -m venv /tmp/convert-venv
#   /tmp/convert-venv/bin/pip install torch numpy sentencepiece safetensors
#   LLAMA_CPP=/path/to/llama.cpp PYTHON=/tmp/convert-venv/bin/python tools/llamacpp/make_test_files.sh
#
# llama.cpp's source: the llama-cpp-python 0.3.36 sdist (`pip download
# --no-deps --no-binary :all: llama-cpp-python==0.3.36`), vendor/llama.cpp,
# built with `cmake -B build && cmake --build build --target llama-quantize`.
set -euo pipefail
cd "$(dirname "$0")/../.."
: "${LLAMA_CPP:?set LLAMA_CPP to a llama.cpp source tree}"
PYTHON="${PYTHON:-python3}"
OUT=worker/tests/data/llamacpp
mkdir -p "$OUT"
for model in tiny-qwen3-yarn tiny-gemma3 tiny-glm4-moe tiny-gpt-oss tiny-mixtral tiny-qwen3-moe; do
    LLAMA_CPP="$LLAMA_CPP" "$PYTHON" tools/llamacpp/convert_tiny.py "../shared/models/$model" "$OUT/$model-f32.gguf"
done
