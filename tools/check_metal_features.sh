#!/usr/bin/env bash
# The macOS feature graph (issue 54): every candle crate the worker links
# on aarch64-apple-darwin that has a `metal` feature must have it on. A crate
# without it builds and links fine, and then fails at run time on the first
# op it has no Metal kernel for (candle-nn without `metal` stopped every
# model at its first RMSNorm). `cargo tree` resolves the graph for the
# target without its standard library, so this runs on any Linux machine.
set -euo pipefail
cd "$(dirname "$0")/.."

target=aarch64-apple-darwin
status=0
# The candle crates in the graph on the target that declare a
# `metal` feature, from cargo's own metadata.
crates=$(cargo metadata --format-version 1 --filter-platform "$target" 2>/dev/null | python3 -c '
import json, sys
meta = json.load(sys.stdin)
print(" ".join(sorted({p["name"] for p in meta["packages"]
                   if p["name"].startswith("candle-") and "metal" in p["features"]})))
')
for package in tinyvllm-worker tinyvllm-kernels; do
    for crate in $crates; do
        tree=$(cargo tree --target "$target" -e features -p "$package" -i "$crate" 2>/dev/null || true)
        if [ -z "$tree" ]; then
            continue # not in this package's graph
        fi
        if grep -q "^[│├└ ─]*$crate feature \"metal\"" <<<"$tree"; then
            echo "check_metal_features: $package -> $crate has \"metal\" on $target"
        else
            echo "error: $package links $crate on $target without its \"metal\" feature:" >&2
            echo "$tree" >&2
            status=1
        fi
    done
done
exit $status
