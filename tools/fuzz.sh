#!/usr/bin/env bash
# Runs the cargo-fuzz targets in fuzz/ (issue 31), one after another, each
# for a number of executions or seconds, and prints one summary line per
# target: executions, crashes, seconds. The checked-in corpus
# (fuzz/corpus/<target>) seeds each run and is never written to; new inputs
# go to fuzz/target/corpus/<target>, which --minimize merges back.
#
#   tools/fuzz.sh --runs 10000000 wire_frame   # 10M executions of one target
#   tools/fuzz.sh --seconds 20                 # every target, 20 s each
#   tools/fuzz.sh --minimize                   # shrink corpus + new finds into fuzz/corpus
#   tools/fuzz.sh --dev --seconds 10           # CI's smoke pass: an unoptimized build, quicker to make
#   tools/fuzz.sh --no-trace-compares --runs 10000000 detokenizer
#                                              # 2-5x the executions: no comparison hooks
#
# Needs cargo-fuzz (`cargo install cargo-fuzz --locked`). Uses the nightly
# toolchain when there is one, else stable with RUSTC_BOOTSTRAP=1 (libFuzzer
# builds need -Z flags). FUZZ_SANITIZER=address for ASan (default none: the
# code is safe Rust, and the speed buys executions). A crash leaves its
# input in fuzz/artifacts/<target>/ and makes the script exit 1.
set -euo pipefail
SCRIPT="$(cd "$(dirname "$0")" && pwd)/$(basename "$0")"
cd "$(dirname "$0")/../fuzz"

ALL_TARGETS=(wire_frame http_request detokenizer chat_template)
RUNS="" SECONDS_EACH="" MINIMIZE=0 PROFILE=release TRACE_COMPARES=1 TARGETS=()
while [ $# -gt 0 ]; do
    case "$1" in
        --runs) RUNS="$2"; shift 2 ;;
        --seconds) SECONDS_EACH="$2"; shift 2 ;;
        --minimize) MINIMIZE=1; shift ;;
        --dev) PROFILE=debug; shift ;;
        --no-trace-compares) TRACE_COMPARES=0; shift ;;
        -h|--help) awk 'NR > 1 && !/^#/ { exit } NR > 1' "$SCRIPT"; exit 0 ;;
        -*) echo "unknown option $1" >&2; exit 2 ;;
        *) TARGETS+=("$1"); shift ;;
    esac
done
[ ${#TARGETS[@]} -gt 0 ] || TARGETS=("${ALL_TARGETS[@]}")
if [ -z "$RUNS" ] && [ -z "$SECONDS_EACH" ] && [ "$MINIMIZE" = 0 ]; then
    SECONDS_EACH=10
fi

if ! cargo fuzz --version >/dev/null 2>&1; then
    echo "error: cargo-fuzz is not installed (cargo install cargo-fuzz --locked)" >&2
    exit 2
fi
TOOLCHAIN=()
if cargo +nightly --version >/dev/null 2>&1; then
    TOOLCHAIN=(+nightly)
else
    export RUSTC_BOOTSTRAP=1
fi
SANITIZER="${FUZZ_SANITIZER:-none}"
# Builds every target (cargo fuzz build takes one or all).
BUILD_FLAGS=(--debug-assertions --sanitizer "$SANITIZER")
[ "$PROFILE" = debug ] && BUILD_FLAGS+=(--dev)
# Comparison hooks guide the fuzzer through magic values, but took about
# half of detokenizer's and http_request's time (tokenizers' code is full
# of comparisons). Such a build goes to a target directory of its own.
TARGET_DIR=target
if [ "$TRACE_COMPARES" = 0 ]; then
    BUILD_FLAGS+=(--no-trace-compares --target-dir target-ntc)
    TARGET_DIR=target-ntc
fi
cargo "${TOOLCHAIN[@]}" fuzz build "${BUILD_FLAGS[@]}" 2>&1 \
    | grep -Ev '^\s+(Compiling|Fresh)' || true
TRIPLE="$(rustc -vV | sed -n 's/^host: //p')"
BIN_DIR="$TARGET_DIR/$TRIPLE/$PROFILE"
for t in "${TARGETS[@]}"; do
    [ -x "$BIN_DIR/$t" ] || { echo "error: $BIN_DIR/$t was not built" >&2; exit 2; }
done

# Longest input per target: detokenizer inputs are 2 bytes a token, and
# 128 tokens stream like a few thousand (the window is small), while longer
# inputs only slow each execution (every step decodes twice).
max_len() {
    case "$1" in detokenizer) echo 256 ;; *) echo 4096 ;; esac
}

json_dict() {
    case "$1" in http_request | chat_template) echo "-dict=dict/json.dict" ;; esac
}

status=0
for t in "${TARGETS[@]}"; do
    work="target/corpus/$t" logs="target/logs"
    mkdir -p "$work" "$logs" "artifacts/$t"
    if [ "$MINIMIZE" = 1 ]; then
        merged="target/merged/$t"
        rm -rf "$merged" && mkdir -p "$merged"
        "$BIN_DIR/$t" -merge=1 -max_len="$(max_len "$t")" "$merged" "corpus/$t" "$work" >"$logs/$t.merge.log" 2>&1
        # Named regression inputs stay whether or not they add coverage.
        cp corpus/"$t"/regression-* "$merged"/ 2>/dev/null || true
        rm -rf "corpus/$t" && mv "$merged" "corpus/$t"
        echo "$t: corpus minimized to $(ls "corpus/$t" | wc -l) files, $(du -sh "corpus/$t" | cut -f1)"
        continue
    fi
    limit=()
    [ -n "$RUNS" ] && limit+=("-runs=$RUNS")
    [ -n "$SECONDS_EACH" ] && limit+=("-max_total_time=$SECONDS_EACH")
    started=$(date +%s)
    rc=0
    # shellcheck disable=SC2046
    "$BIN_DIR/$t" "$work" "corpus/$t" "${limit[@]}" -max_len="$(max_len "$t")" -timeout=10 -rss_limit_mb=2048 \
        -print_final_stats=1 -artifact_prefix="artifacts/$t/" $(json_dict "$t") >"$logs/$t.log" 2>&1 || rc=$?
    elapsed=$(( $(date +%s) - started ))
    execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$logs/$t.log" | tail -1)
    crashes=0
    if [ "$rc" != 0 ]; then
        crashes=1 status=1
        grep -E 'panicked|ERROR: libFuzzer|Test unit written' "$logs/$t.log" | head -5 >&2 || true
    fi
    echo "$t: executions=${execs:-0} crashes=$crashes seconds=$elapsed exec/s=$(( ${execs:-0} / (elapsed > 0 ? elapsed : 1) )) log=fuzz/$logs/$t.log"
done
exit $status
