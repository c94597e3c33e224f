#!/usr/bin/env bash
# CPU benchmarks of issue 8, ours and (optionally) llama.cpp's in one run,
# on the same GGUF files, same thread count.
#
#   tools/bench_cpu.sh GGUF_DIR [LLAMA_CPP_BIN_DIR]   # everything, once
#   PARTS=decode ROUNDS=4 tools/bench_cpu.sh ...  # one part, ours and llama.cpp's
#                                          # alternating, ROUNDS times (default 1);
#                                          # parts: decode (batch 1), prefill (512),
#                                          # batched (16 concurrent), server
#   PARTS=decode REPS=5 TYPES=f16 ...      # decode alternates REPS runs a round (3)
#
# GGUF_DIR gets (if missing) random TinyLlama-1.1B-shaped weights written by
# `tinyvllm-worker export-gguf` (f16, q8_0) and stories260K (f32); give a
# llama.cpp build's bin/ (llama-bench, llama-batched-bench, llama-server),
# built by you outside this repository, to measure it on the same files.
set -euo pipefail
cd "$(dirname "$0")/.."
GGUF=${1:?usage: tools/bench_cpu.sh GGUF_DIR [LLAMA_CPP_BIN_DIR]}
LLAMA=${2:-}
THREADS=${THREADS:-2}
mkdir -p "$GGUF"
cargo build --release -q -p tinyvllm-worker -p tinyvllm-coordinator
W=target/release/tinyvllm-worker
for t in f16 q8_0; do
  f="$GGUF/tinyllama-1.1b-random-$t.gguf"
  [ -f "$f" ] || $W export-gguf --model random:tinyllama-1.1b --type "$t" --out "$f"
done
[ -f "$GGUF/stories260K-f32.gguf" ] || $W export-gguf --model tests/models/stories260K --type f32 --out "$GGUF/stories260K-f32.gguf"
# The coordinator needs a tokenizer beside the file; prompts are token ids,
# so any 32000-token vocabulary will do (tiny-qwen3's).
cp tests/models/tiny-qwen3/tokenizer.json tests/models/tiny-qwen3/tokenizer_config.json "$GGUF/"
export RAYON_NUM_THREADS=$THREADS

echo "== machine"; nproc; grep -m1 "model name" /proc/cpuinfo || true; uptime
bench() { $W bench --kv-cache-memory 2000000000 "$@" 2>&1 | grep -E "^(throughput|TTFT|TPOT|bandwidth|paired|cross-core|  )"; }
# f16 and Q8_0, and Q4_K_M where GGUF_DIR holds it (`export-gguf --type
# q4_k_m` takes minutes, so it is not written here).
# TYPES picks some of them.
types() {
  if [ -n "${TYPES:-}" ]; then echo "$TYPES"; return; fi
  echo f16 q8_0; [ ! -f "$GGUF/tinyllama-1.1b-random-q4_k_m.gguf" ] || echo q4_k_m
}
if [ "${PARTS:-all}" = all ]; then
for t in $(types); do
  m="$GGUF/tinyllama-1.1b-random-$t.gguf"
  echo "== ours $t: batch-1 decode (prompt 16, 64 generated)"; bench --model "$m" --num-prompts 1 --input-len 16 --output-len 64 --profile
  echo "== ours $t: prefill 512 (TTFT of one 512-token prompt)"; bench --model "$m" --num-prompts 1 --input-len 512 --output-len 1
  if [ -n "$LLAMA" ]; then
    echo "== llama.cpp $t: llama-bench"; "$LLAMA/llama-bench" -m "$m" -t "$THREADS" -p 512 -n 64 -r 3 2>/dev/null | grep -E "^\|"
  fi
done
echo "== ours stories260K f32: batch-1 decode"; bench --model "$GGUF/stories260K-f32.gguf" --num-prompts 1 --input-len 16 --output-len 256 --profile
if [ -n "$LLAMA" ]; then
  echo "== llama.cpp stories260K f32"; "$LLAMA/llama-bench" -m "$GGUF/stories260K-f32.gguf" -t "$THREADS" -p 0 -n 256 -r 3 2>/dev/null | grep -E "^\|"
fi
fi # PARTS
m="$GGUF/tinyllama-1.1b-random-f16.gguf"
batched() {
  echo "== ours f16: 16 concurrent (prompt 128, 64 generated each)"; bench --model "$m" --num-prompts 16 --input-len 128 --output-len 64
  if [ -n "$LLAMA" ]; then
    echo "== llama.cpp f16: llama-batched-bench"; "$LLAMA/llama-batched-bench" -m "$m" -t "$THREADS" -c 8192 -npp 128 -ntg 64 -npl 16 2>/dev/null | grep -E "^\|"
  fi
}

# The server workload: 16 concurrent streams, 103-token prompts, 64 tokens
# each with ignore_eos, through the whole cluster (coordinator + 1 worker).
workload() { target/release/tinyvllm-bench workload --url "$1" --groups 16 --queries 1 --prefix-tokens 0 \
  --suffix-tokens 103 --rate 1000000 --max-tokens 64 --vocab-size 32000 --first-token 3; }
server() {
  echo "== ours: server workload through the cluster"
  target/release/tinyvllm-coordinator --model "$m" --http 127.0.0.1:18080 --local-workers 1 \
    --cluster-secret-file "${TMPDIR:-/tmp}/tinyvllm-bench-cluster-secret" \
    --worker-arg=--kv-cache-memory=2000000000 > /tmp/tinyvllm-bench-coordinator.log 2>&1 &
  COORD=$!
  trap 'kill $COORD 2>/dev/null || true' EXIT
  for _ in $(seq 1 120); do curl -sf 127.0.0.1:18080/health >/dev/null 2>&1 && break; sleep 1; done
  workload http://127.0.0.1:18080
  kill $COORD; wait $COORD 2>/dev/null || true
  if [ -n "$LLAMA" ]; then
    echo "== llama.cpp: server workload (llama-server -np 8 -c 8192 --cont-batching)"
    "$LLAMA/llama-server" -m "$m" -t "$THREADS" -np 8 -c 8192 --cont-batching --port 18081 > /tmp/llama-server-bench.log 2>&1 &
    LS=$!
    for _ in $(seq 1 120); do curl -sf 127.0.0.1:18081/health >/dev/null 2>&1 && break; sleep 1; done
    workload http://127.0.0.1:18081
    kill $LS; wait $LS 2>/dev/null || true
  fi
}

# median of the numbers on stdin, one a line
median() { sort -g | awk '{ v[NR] = $1 } END { if (NR) print (NR % 2 ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2) }'; }
# Batch-1 decode and prefill of one 512-token prompt, in f16 and Q8_0.
# Decode alternates one 64-token run of each engine REPS times (default 3):
# the bandwidth here changes within seconds, and llama-bench's own -r 3
# would average three runs against our one.
decode() {
  for t in $(types); do
    local f="$GGUF/tinyllama-1.1b-random-$t.gguf" ours_runs="" llama_runs="" out line
    for rep in $(seq 1 "${REPS:-3}"); do
      out=$(bench --model "$f" --num-prompts 1 --input-len 16 --output-len 64 --profile | grep -E "^(TPOT|bandwidth|paired|cross-core)")
      echo "== ours $t: batch-1 decode, run $rep"; echo "$out"
      ours_runs+="$(sed -nE 's/.*decode ([0-9.]+) tok\/s.*/\1/p' <<<"$out")"$'\n'
      if [ -n "$LLAMA" ]; then
        line=$("$LLAMA/llama-bench" -m "$f" -t "$THREADS" -p 0 -n 64 -r 1 2>/dev/null | grep -E "tg64" || true)
        echo "== llama.cpp $t: tg64, run $rep"; echo "$line"
        llama_runs+="$(awk -F'|' '{ split($(NF - 1), a, " "); print a[1] }' <<<"$line")"$'\n'
      fi
    done
    echo "== $t batch-1 decode, medians of ${REPS:-3} alternating runs: ours $(grep . <<<"$ours_runs" | median) tok/s," \
      "llama.cpp $(grep . <<<"$llama_runs" | median || true) tok/s"
  done
}
prefill() {
  for t in $(types); do
    local f="$GGUF/tinyllama-1.1b-random-$t.gguf"
    echo "== ours $t: prefill 512"; bench --model "$f" --num-prompts 1 --input-len 512 --output-len 1 | grep -E "^TTFT"
    if [ -n "$LLAMA" ]; then
      echo "== llama.cpp $t: pp512"; "$LLAMA/llama-bench" -m "$f" -t "$THREADS" -p 512 -n 0 -r 3 2>/dev/null | grep -E "pp512"
    fi
  done
}

if [ "${PARTS:-all}" = all ]; then
  batched
  server
else
  # The machine drifts by tens of percent within minutes: alternate the two
  # engines so that each pair of figures shares a phase.
  for round in $(seq 1 "${ROUNDS:-1}"); do
    echo "== round $round"
    "$PARTS"
  done
fi
