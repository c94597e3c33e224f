#!/usr/bin/env bash
# Syntax-checks our Metal kernels on any machine, Apple compiler or not:
# every kernels/src/metal/*.metal (or the files given as arguments) is parsed
# as C++17 against a declarations-only shim of the Metal standard library
# (kernels/src/metal/shim/), and every template instantiation in it is
# type-checked, with g++ and with clang++ where installed. Warnings are
# errors, except the compilers' notes on the Metal attributes they do not
# know ([[buffer(n)]], [[kernel]], ...).
#
# It catches typos, type mismatches and undeclared names before a Mac ever
# sees the code; it cannot catch what only Apple's compiler knows (address
# space rules, threadgroup memory limits). Exits non-zero if any file fails.
set -euo pipefail
cd "$(dirname "$0")/.."

shim=kernels/src/metal/shim
if [ "$#" -gt 0 ]; then
    files=("$@")
else
    shopt -s nullglob
    files=(kernels/src/metal/*.metal)
    shopt -u nullglob
fi
if [ "${#files[@]}" -eq 0 ]; then
    echo "error: no .metal files found under kernels/src/metal" >&2
    exit 1
fi

compilers=()
for cxx in g++ clang++; do
    if command -v "$cxx" >/dev/null; then compilers+=("$cxx"); fi
done
if [ "${#compilers[@]}" -eq 0 ]; then
    echo "error: neither g++ nor clang++ is installed" >&2
    exit 1
fi

common=(-std=c++17 -fsyntax-only -Wall -Wextra -Werror -I "$shim" -include "$shim/metal_shim.h" -x c++)
failed=0
for cxx in "${compilers[@]}"; do
    case "$cxx" in
        clang++) quiet=(-Wno-unknown-attributes -Wno-ignored-attributes) ;;
        *) quiet=(-Wno-attributes) ;;
    esac
    for f in "${files[@]}"; do
        if "$cxx" "${common[@]}" "${quiet[@]}" "$f"; then
            echo "ok    $cxx  $f"
        else
            echo "FAIL  $cxx  $f"
            failed=1
        fi
    done
done
if [ "$failed" -ne 0 ]; then
    echo "Metal syntax check failed" >&2
    exit 1
fi
echo "Metal syntax check passed (${#files[@]} files)"
