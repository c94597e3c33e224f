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
# built with `cmake -B build && cmake --build build --target llama llama-quantize`.
set -euo pipefail
cd "$(dirname "$0")/../.."
: "${LLAMA_CPP:?set LLAMA_CPP to a llama.cpp source tree}"
PYTHON="${PYTHON:-python3}"
OUT=worker/tests/data/llamacpp
mkdir -p "$OUT"
for model in tiny-qwen3-yarn tiny-gemma3 tiny-glm4-moe tiny-gpt-oss tiny-mixtral tiny-qwen3-moe; do
    LLAMA_CPP="$LLAMA_CPP" "$PYTHON" tools/llamacpp/convert_tiny.py "tests/models/$model" "$OUT/$model-f32.gguf"
done

# gpt-oss with MXFP4 experts (the other matrices Q8_0), and llama.cpp's own
# greedy next token at every position of each golden case, teacher-forced.
"$LLAMA_CPP/build/bin/llama-quantize" "$OUT/tiny-gpt-oss-f32.gguf" "$OUT/tiny-gpt-oss-mxfp4.gguf" MXFP4_MOE
GREEDY="${TMPDIR:-/tmp}/tinyvllm-greedy"
g++ -O2 -std=c++17 tools/llamacpp/greedy.cpp -I"$LLAMA_CPP/include" -I"$LLAMA_CPP/ggml/include" \
    -L"$LLAMA_CPP/build/bin" -lllama -lggml -lggml-base -Wl,-rpath,"$LLAMA_CPP/build/bin" -o "$GREEDY"
GREEDY="$GREEDY" python3 - "$OUT/tiny-gpt-oss-mxfp4.gguf" "$OUT/tiny-gpt-oss-mxfp4.llama-cpp.json" <<'PY'
import json, os, subprocess, sys
gguf, out = sys.argv[1], sys.argv[2]
cases = json.load(open("tests/golden/tiny-gpt-oss.json"))["cases"]
def next_id(context):
    run = subprocess.run([os.environ["GREEDY"], gguf, "1", ",".join(map(str, context))], capture_output=True,
                         text=True, check=True, env=dict(os.environ, GREEDY_NO_FA="1"))
    return int(run.stdout.strip().split(",")[0])
about = ("llama.cpp's greedy next token at every position of each tiny-gpt-oss golden case, given the golden "
         "context (teacher-forced), on tiny-gpt-oss-mxfp4.gguf: tools/llamacpp/make_test_files.sh")
recorded = [{"id": c["id"], "next_ids": [next_id(c["prompt_ids"] + c["generated_ids"][:t])
                                         for t in range(len(c["generated_ids"]))]} for c in cases]
json.dump({"about": about, "cases": recorded}, open(out, "w"))
PY

# tiny-gpt-oss as the published gpt-oss checkpoints are stored (experts in
# MXFP4, Hugging Face's layout), and llama.cpp's conversion of it (its
# MXFP4 repacking path).
"$PYTHON" tools/llamacpp/make_mxfp4_checkpoint.py tests/models/tiny-gpt-oss worker/tests/data/tiny-gpt-oss-mxfp4
chmod u+w worker/tests/data/tiny-gpt-oss-mxfp4/*
LLAMA_CPP="$LLAMA_CPP" "$PYTHON" tools/llamacpp/convert_tiny.py worker/tests/data/tiny-gpt-oss-mxfp4 "$OUT/tiny-gpt-oss-mxfp4-hf.gguf"
