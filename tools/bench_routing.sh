#!/usr/bin/env bash
# Runs the shared-prefix workload (tinyvllm-bench workload) against a fresh
# 2-worker cluster once per routing policy and prints each report.
#
#   tools/bench_routing.sh MODEL_DIR [policy ...]
#
# Workers get one thread each (RAYON_NUM_THREADS=1: 2 workers on 2 cores) and
# a KV cache of $KV_BYTES, small enough that one worker cannot keep every
# group's prefix: that is where routing matters. Override the workload with
# the WORKLOAD variable (tinyvllm-bench workload flags).
set -euo pipefail
MODEL=${1:?model directory}
shift
POLICIES=${*:-round_robin least_load power_of_two prefix_aware}
KV_BYTES=${KV_BYTES:-73728000}
# Chunked prefill in small steps, so a cache hit is not stuck behind a long miss.
WORKER_ARGS=${WORKER_ARGS:---max-num-batched-tokens=64}
WORKLOAD=${WORKLOAD:---groups 8 --prefix-tokens 256 --queries 6 --suffix-tokens 16 --max-tokens 8 --rate 1.0}
BIN=${BIN:-./target/release}
PORT=${PORT:-18080}
for policy in $POLICIES; do
    dir=$(mktemp -d)
    RAYON_NUM_THREADS=1 "$BIN/tinyvllm-coordinator" --model "$MODEL" --http "127.0.0.1:$PORT" --quic 127.0.0.1:0 \
        --local-workers 2 --policy "$policy" --cluster-secret-file "$dir/secret" \
        --worker-arg="--kv-cache-memory=$KV_BYTES" --worker-arg="$WORKER_ARGS" > "$dir/out" 2> "$dir/err" &
    pid=$!
    for _ in $(seq 1 300); do
        if curl -sf "http://127.0.0.1:$PORT/health" | grep -q '"workers":2'; then break; fi
        sleep 0.2
    done
    echo "== policy $policy"
    # shellcheck disable=SC2086
    "$BIN/tinyvllm-bench" workload --url "http://127.0.0.1:$PORT" $WORKLOAD || true
    kill -TERM "$pid"; wait "$pid" || true
    rm -rf "$dir"
done
