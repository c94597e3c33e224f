#!/usr/bin/env bash
# Plants known bugs in copies of the Metal kernels and shows that the Linux
# tests catch each one: for every mutant below, the kernels/src/metal/*.metal
# sources are copied to a temporary directory, one exact text edit is made,
# the CPU emulator (kernels/metal-emu) is rebuilt from that directory
# (TINYVLLM_METAL_SRC) and the quicker tests of
# `cargo test -p tinyvllm-kernels --test metal` must fail. The real sources
# are never touched.
#
# Usage: tools/metal_mutants.sh [name...]   (default: every mutant)
# Exits non-zero if a mutant survives or an edit no longer applies (the
# kernel changed: update the edit here).
set -euo pipefail
cd "$(dirname "$0")/.."

# name | file | exact text | replacement (python string literals)
mutants=(
  "gqa-mapping|paged_attention.metal|'head / (p.num_heads / p.num_kv_heads)'|'head % p.num_kv_heads'"
  "in-block-offset|paged_attention.metal|'table[pos / block_size] * block_size + pos % block_size'|'table[pos / block_size] * block_size + (pos + 1) % block_size'"
  "partition-overlap|paged_attention.metal|'end = min(end, (part + 1) * kPartitionSize);'|'end = min(end, (part + 1) * kPartitionSize + 8);'"
  "reduce-rescale|paged_attention.metal|'s += sums[i] * fast::exp(maxes[i] - total_max);'|'s += sums[i];'"
  "causal-off-by-one|prefill_attention.metal|'key <= pos[r] &&'|'key <= pos[r] + 1 &&'"
  "window-off-by-one|prefill_attention.metal|'? pos + 1 - window : 0;'|'? pos - window : 0;'"
  "missing-barrier|prefill_attention.metal|'      v_tile[f] = v_cache[src];\n    }\n    threadgroup_barrier(mem_flags::mem_threadgroup);'|'      v_tile[f] = v_cache[src];\n    }'"
  "simd-in-divergent-code|paged_attention.metal|'run_sum = run_sum * correction + simd_sum(weight);'|'run_sum = has_key ? run_sum * correction + simd_sum(weight) : run_sum * correction;'"
)

wanted=("$@")
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
survived=()
for m in "${mutants[@]}"; do
    IFS='|' read -r name file from to <<<"$m"
    if [ "${#wanted[@]}" -gt 0 ] && [[ ! " ${wanted[*]} " == *" $name "* ]]; then continue; fi
    dir="$tmp/$name"
    mkdir -p "$dir"
    cp kernels/src/metal/*.metal "$dir/"
    python3 - "$dir/$file" "$from" "$to" <<'PY'
import ast, sys
path, old, new = sys.argv[1], ast.literal_eval(sys.argv[2]), ast.literal_eval(sys.argv[3])
text = open(path).read()
if text.count(old) != 1:
    sys.exit(f"the edit does not apply: {old!r} occurs {text.count(old)} times in {path}")
open(path, "w").write(text.replace(old, new))
PY
    log="$tmp/$name.log"
    # The quicker tests between them cover every mutant (GQA, partitions,
    # the reduce, prefill tiles, windows, short decode chunks).
    if TINYVLLM_METAL_SRC="$dir" cargo test -q -p tinyvllm-kernels --test metal -- \
        every_head_dim sliding_window write_then_attend >"$log" 2>&1; then
        echo "SURVIVED  $name"
        survived+=("$name")
    else
        first=$(grep -m1 -E "panicked|error|emulator" "$log" | cut -c1-150 || true)
        echo "caught    $name: $first"
    fi
done
if [ "${#survived[@]}" -gt 0 ]; then
    echo "mutants the tests did not catch: ${survived[*]}" >&2
    exit 1
fi
echo "every planted bug was caught"
