#!/usr/bin/env bash
# The mixture-of-experts benchmark of issue 55, ours and llama.cpp's on the
# same GGUF files, same threads, alternating file by file, ROUNDS times:
# a reduced-depth Qwen3-30B-A3B (all 128 experts, top 8, the first 8 of its
# 48 layers) at Q8_0 and Q4_K_M: batch-1 prefill 512 and decode, and
# decode at 16 concurrent streams.
#
#   tools/bench_moe.sh DIR LLAMA_CPP_BIN_DIR
#
# DIR gets (if missing) the random weights (`export-random --preset
# qwen3-30b-a3b --num-layers 8`, 10 GB of f16) and the two GGUF files
# `export-gguf` writes from them (5.1 and 2.9 GiB). llama.cpp's bin/
# (llama-bench, llama-batched-bench) is a build of yours outside this
# repository. Our figures: 512 / TTFT, 1000 / TPOT, 16 x 1000 / TPOT.
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:?usage: tools/bench_moe.sh DIR LLAMA_CPP_BIN_DIR}
LLAMA=${2:?usage: tools/bench_moe.sh DIR LLAMA_CPP_BIN_DIR}
THREADS=${THREADS:-2}
ROUNDS=${ROUNDS:-1}
export RAYON_NUM_THREADS=$THREADS
mkdir -p "$DIR"
cargo build --release -q -p tinyvllm-worker
W=target/release/tinyvllm-worker
[ -f "$DIR/q3moe8/config.json" ] || $W export-random --preset qwen3-30b-a3b --num-layers 8 \
  --tokenizer-from tests/models/tiny-qwen3 --out "$DIR/q3moe8"
for t in q8_0 q4_k_m; do
  [ -f "$DIR/q3moe8-$t.gguf" ] || $W export-gguf --model "$DIR/q3moe8" --out "$DIR/q3moe8-$t.gguf" --type "$t"
done
for round in $(seq "$ROUNDS"); do
  for t in q8_0 q4_k_m; do
    f="$DIR/q3moe8-$t.gguf"
    echo "### round $round $t $(date -u +%H:%M:%S)"
    "$LLAMA/llama-bench" -m "$f" -t "$THREADS" -p 512 -n 64 -r 2 -o md 2>/dev/null | grep -E "pp512|tg64"
    $W bench --model "$f" --num-prompts 1 --input-len 512 --output-len 1 2>&1 | grep -E "TTFT"
    $W bench --model "$f" --num-prompts 1 --input-len 16 --output-len 64 --profile 2>&1 | grep -E "TPOT|bandwidth limit"
    "$LLAMA/llama-batched-bench" -m "$f" -t "$THREADS" -c 4096 -npp 128 -ntg 64 -npl 16 2>/dev/null | grep -E "^\|\s+128"
    $W bench --model "$f" --num-prompts 16 --input-len 128 --output-len 64 2>&1 | grep -E "TPOT"
  done
done
