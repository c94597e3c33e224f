#!/usr/bin/env bash
# llama.cpp against tests/golden on the GGUF files `export-gguf` writes:
# every golden case's greedy ids from llama.cpp itself (tools/llamacpp/greedy.cpp,
# f32 KV cache, flash attention off: llama.cpp's CPU flash attention rounds
# through f16). Not part of CI (it needs a llama.cpp build, ~30 min on 2 cores).
#
#   LLAMA_CPP=/path/to/llama.cpp (built: cmake -B build && cmake --build build --target llama)
#   tools/llamacpp/check_goldens.sh stories260K tiny-qwen3 tiny-mixtral tiny-qwen3-moe
#
# llama.cpp's source: the llama-cpp-python 0.3.36 sdist (`pip download
# --no-deps --no-binary :all: llama-cpp-python==0.3.36`), vendor/llama.cpp.
set -euo pipefail
cd "$(dirname "$0")/../.."
: "${LLAMA_CPP:?set LLAMA_CPP to a built llama.cpp source tree}"
OUT="${TMPDIR:-/tmp}/tinyvllm-llamacpp-check"
mkdir -p "$OUT"
g++ -O2 -std=c++17 tools/llamacpp/greedy.cpp -I"$LLAMA_CPP/include" -I"$LLAMA_CPP/ggml/include" \
    -L"$LLAMA_CPP/build/bin" -lllama -lggml -lggml-base -Wl,-rpath,"$LLAMA_CPP/build/bin" -o "$OUT/greedy"
cargo build --release -p tinyvllm-worker --quiet
status=0
for model in "$@"; do
    gguf="$OUT/$model-f32.gguf"
    target/release/tinyvllm-worker export-gguf --model "tests/models/$model" --out "$gguf" --type f32 >/dev/null
    GREEDY="$OUT/greedy" python3 - "$model" "$gguf" <<'PY' || status=1
import json, os, subprocess, sys
model, gguf = sys.argv[1], sys.argv[2]
cases = json.load(open(f"tests/golden/{model}.json"))["cases"]
differ = []
for c in cases:
    want = c["generated_ids"]
    run = subprocess.run([os.environ["GREEDY"], gguf, str(len(want)), ",".join(map(str, c["prompt_ids"]))],
                         capture_output=True, text=True, env=dict(os.environ, GREEDY_NO_FA="1"))
    got = [int(x) for x in run.stdout.split(",")] if run.stdout.strip() else []
    if got != want:
        differ.append((c["id"], run.stderr.strip()[-200:]))
print(f"{model}: {len(cases) - len(differ)}/{len(cases)} golden cases from llama.cpp", differ or "")
sys.exit(1 if differ else 0)
PY
done
exit $status
