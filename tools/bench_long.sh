#!/usr/bin/env bash
# Long contexts, ours and llama.cpp's on the same GGUF files (issue 59):
# prefill of N tokens and batch-1 decode at about N tokens of context, on
# SmolLM-135M's shape (its max positions raised to 40960), f16 and Q8_0.
#
#   tools/bench_long.sh DIR LLAMA_CPP_BIN_DIR
#   CONTEXTS="4096 16384 32768" TYPES="f16 q8_0" tools/bench_long.sh ...
#
# DIR gets (if missing) the random weights and their GGUF files. llama.cpp
# runs with flash attention on (`-fa 1`), prefill as `-p N -n 0`, decode as
# `-p 0 -n 64 -d N`; ours as `bench --input-len N` with one output token
# (N / TTFT) and with 65 (1000 / TPOT, and --profile's attention share).
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:?usage: tools/bench_long.sh DIR LLAMA_CPP_BIN_DIR}
LLAMA=${2:?usage: tools/bench_long.sh DIR LLAMA_CPP_BIN_DIR}
THREADS=${THREADS:-2}
export RAYON_NUM_THREADS=$THREADS
cargo build --release -q -p tinyvllm-worker
W=target/release/tinyvllm-worker
mkdir -p "$DIR"
. "$(dirname "$0")/smollm_random.sh"
ensure_smollm "$DIR" "$W"
for t in ${TYPES:-f16 q8_0}; do
  [ -f "$DIR/smollm-$t.gguf" ] || $W export-gguf --model "$DIR/smollm" --out "$DIR/smollm-$t.gguf" --type "$t"
done
for n in ${CONTEXTS:-4096 16384}; do
  for t in ${TYPES:-f16 q8_0}; do
    f="$DIR/smollm-$t.gguf"
    echo "### $t context $n $(date -u +%H:%M:%S)"
    "$LLAMA/llama-bench" -m "$f" -t "$THREADS" -fa 1 -p "$n" -n 0 -r 1 2>/dev/null | grep -E "pp$n"
    $W bench --model "$f" --num-prompts 1 --input-len "$n" --output-len 1 --max-model-len $((n + 128)) \
      --kv-cache-memory 4000000000 2>&1 | grep TTFT
    "$LLAMA/llama-bench" -m "$f" -t "$THREADS" -fa 1 -p 0 -n 64 -d "$n" -r 1 2>/dev/null | grep -E "tg64"
    $W bench --model "$f" --num-prompts 1 --input-len "$n" --output-len 65 --max-model-len $((n + 128)) \
      --kv-cache-memory 4000000000 --profile 2>&1 | grep -E "TPOT|^  attention|^  matmuls"
  done
done
