#!/usr/bin/env bash
# Long contexts, ours and llama.cpp's on the same GGUF files (issue 59):
# prefill of N tokens, and decode at about N tokens of context for 1 and 4
# sequences, on the SmolLM-135M shape (default) or TinyLlama-1.1B's
# (MODEL=tinyllama), random weights with max positions raised to 40960.
#
#   tools/bench_long.sh DIR LLAMA_CPP_BIN_DIR
#   MODEL=tinyllama CONTEXTS="4096 16384" TYPES=f16 BATCHES="1 4" KV="auto f16" tools/bench_long.sh ...
#
# DIR gets (if missing) the random weights and their GGUF files. llama.cpp
# runs with flash attention on and its default f16 cache: prefill as
# `llama-bench -p N -n 0`, batch-1 decode as `-p 0 -n 64 -d N`, batch-4
# decode as `llama-batched-bench -npp N -ntg 64 -npl 4` (its S_TG: the
# prompts are all computed before any sequence decodes). Ours: `bench
# --input-len N` with one output token (N / TTFT), and with 65 for decode
# (B x 1000 / TPOT, and --profile's attention share) with each KV cache
# format in KV (auto: our default, f32 on the CPU; f16 as llama.cpp's); a step's token
# budget holds all B prompts, so ours too decode the B together.
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:?usage: tools/bench_long.sh DIR LLAMA_CPP_BIN_DIR}
LLAMA=${2:?usage: tools/bench_long.sh DIR LLAMA_CPP_BIN_DIR}
THREADS=${THREADS:-2}
MODEL=${MODEL:-smollm}
export RAYON_NUM_THREADS=$THREADS
cargo build --release -q -p tinyvllm-worker
W=target/release/tinyvllm-worker
mkdir -p "$DIR"
. "$(dirname "$0")/random_model.sh"
# ours LABEL BENCH_ARGS...: the figures of one `bench` run, or why it failed.
ours() {
  local label=$1 out
  shift
  if out=$("$W" bench "$@" 2>&1); then
    grep -E "TTFT|TPOT|^  attention|^  step total" <<<"$out" | sed "s/^/ours $label: /"
  else
    echo "ours $label FAILED: $(tail -3 <<<"$out")"
  fi
}
case $MODEL in
  smollm) ensure_smollm "$DIR" "$W" ;;
  tinyllama) ensure_random "$DIR" "$W" tinyllama-1.1b tinyllama ;;
  *) echo "MODEL is smollm or tinyllama" >&2; exit 2 ;;
esac
for t in ${TYPES:-f16 q8_0}; do
  [ -f "$DIR/$MODEL-$t.gguf" ] || $W export-gguf --model "$DIR/$MODEL" --out "$DIR/$MODEL-$t.gguf" --type "$t"
done
for n in ${CONTEXTS:-4096 16384}; do
  for t in ${TYPES:-f16 q8_0}; do
    f="$DIR/$MODEL-$t.gguf"
    echo "### $MODEL $t context $n $(date -u +%H:%M:%S)"
    if [[ " ${PARTS:-prefill decode} " == *" prefill "* ]]; then
      "$LLAMA/llama-bench" -m "$f" -t "$THREADS" -fa 1 -p "$n" -n 0 -r 1 2>/dev/null | grep -E "pp$n" | sed 's/^/llama.cpp prefill: /' || echo "llama.cpp prefill FAILED"
      ours prefill --model "$f" --num-prompts 1 --input-len "$n" --output-len 1 --max-model-len $((n + 128)) \
        --kv-cache-memory 4000000000
    fi
    [[ " ${PARTS:-prefill decode} " == *" decode "* ]] || continue
    for b in ${BATCHES:-1 4}; do
      if [ "$b" = 1 ]; then
        "$LLAMA/llama-bench" -m "$f" -t "$THREADS" -fa 1 -p 0 -n 64 -d "$n" -r 1 2>/dev/null | grep -E "tg64" \
          | sed 's/^/llama.cpp decode x1: /' || echo "llama.cpp decode x1 FAILED"
      else
        "$LLAMA/llama-batched-bench" -m "$f" -t "$THREADS" -fa on -c $((b * (n + 64))) -npp "$n" -ntg 64 -npl "$b" \
          2>/dev/null | grep -E "^\|\s+$n" | sed "s/^/llama.cpp decode x$b (S_TG is the 8th column): /" \
          || echo "llama.cpp decode x$b FAILED"
      fi
      for kv in ${KV:-auto f16}; do
        ours "decode x$b, $kv cache" --model "$f" --num-prompts "$b" --input-len "$n" --output-len 65 \
          --max-model-len $((n + 128)) --max-num-batched-tokens $((b * n + 64)) \
          --kv-cache-memory $((b * (n + 256) * 60000)) --kv-cache-dtype "$kv" --profile
      done
    done
  done
done
