#!/usr/bin/env bash
# The agent-session benchmark of issue 60: `tinyvllm-bench agents` against a
# coordinator with 2 local workers of the SmolLM-135M shape (random
# weights, f16 KV cache) whose KV pools hold about 3 sessions each, with the
# second tier off, in host memory, on disk (both without peer fetch), and
# in memory with peer fetch; `unique-*` modes send fresh histories every
# turn (nothing to reuse). One worker thread each (the machine's 2 cores
# shared). Prints one JSON line per mode.
#
#   tools/bench_agents.sh DIR
#   SESSIONS=8 START=8192 TURN=500 TURNS=10 MODES="off ram disk peer unique-off unique-ram" tools/bench_agents.sh DIR
set -euo pipefail
DIR=${1:?usage: tools/bench_agents.sh DIR}
SESSIONS=${SESSIONS:-8}
START=${START:-8192}
TURN=${TURN:-500}
TURNS=${TURNS:-10}
cargo build --release -q -p tinyvllm-worker -p tinyvllm-coordinator
W=target/release/tinyvllm-worker
C=target/release/tinyvllm-coordinator
B=target/release/tinyvllm-bench
mkdir -p "$DIR"
. "$(dirname "$0")/random_model.sh"
ensure_smollm "$DIR" "$W"
longest=$((START + TURN * (TURNS - 1) + 64))
per_token=23040 # 30 layers x 3 kv heads x 64 x K and V x 2 bytes (f16)
kv=$((3 * longest * per_token))
tier=$((SESSIONS * longest * per_token))
for mode in ${MODES:-off ram disk peer unique-off unique-ram}; do
  extra=() unique=()
  case $mode in
    off | unique-off) extra=(--no-peer-fetch) ;;
    *ram) extra=(--no-peer-fetch --worker-arg=--kv-offload-bytes=$tier) ;;
    *disk) rm -rf "$DIR/tier"; extra=(--no-peer-fetch --worker-arg=--kv-offload-bytes=$tier --worker-arg=--kv-offload-dir=$DIR/tier) ;;
    peer) extra=(--worker-arg=--kv-offload-bytes=$tier) ;;
  esac
  case $mode in unique-*) unique=(--unique) ;; esac
  port=$((18000 + RANDOM % 2000))
  RAYON_NUM_THREADS=1 $C --model "$DIR/smollm" --local-workers 2 --no-discovery \
    --http 127.0.0.1:$port --quic 127.0.0.1:$((port + 1)) --cluster-secret-file "$DIR/secret" \
    --worker-arg=--kv-cache-memory=$kv --worker-arg=--kv-cache-dtype=f16 --worker-arg=--max-model-len=$((longest + 64)) \
    "${extra[@]}" >"$DIR/coordinator-$mode.log" 2>&1 &
  pid=$!
  for _ in $(seq 600); do
    n=$(curl -s "127.0.0.1:$port/v1/workers" | python3 -c "import json,sys; print(sum(w['state']=='ready' for w in json.load(sys.stdin)['data']))" 2>/dev/null || echo 0)
    [ "$n" = 2 ] && break
    sleep 0.5
  done
  printf '%s ' "$mode"
  $B agents --url "http://127.0.0.1:$port" --sessions "$SESSIONS" --start-tokens "$START" --turn-tokens "$TURN" \
    --turns "$TURNS" "${unique[@]}" --json
  kill -TERM $pid; wait $pid || true
done
