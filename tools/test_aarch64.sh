#!/usr/bin/env bash
# Runs the kernels crate's tests built for aarch64 (the NEON paths that Macs
# and ARM Linux boxes run for CPU workers) on this x86-64 machine, under
# qemu's user-mode emulation: every kernel against its reference, as on x86.
#
# Needs the Rust target `aarch64-unknown-linux-gnu`, a cross linker
# (`aarch64-linux-gnu-gcc`) and `qemu-aarch64`; Debian's `qemu-user` and
# `gcc-aarch64-linux-gnu` are installed when missing (as root or via sudo),
# the Rust target by rustup. Where rustup cannot fetch it (its server is
# not a package registry) this says so and exits 0: nothing else in CI
# depends on it.
set -euo pipefail
cd "$(dirname "$0")/.."

target=aarch64-unknown-linux-gnu
has_target() { [ -d "$(rustc --print sysroot)/lib/rustlib/$target" ]; }
if ! has_target && ! rustup target add "$target" >/dev/null 2>&1; then
    echo "test_aarch64: skipped, the Rust target $target is not installed and rustup could not fetch it"
    exit 0
fi
if ! command -v qemu-aarch64 >/dev/null || ! command -v aarch64-linux-gnu-gcc >/dev/null; then
    SUDO=""
    if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends \
        qemu-user gcc-aarch64-linux-gnu libc6-dev-arm64-cross >/dev/null
fi

export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_LINKER=aarch64-linux-gnu-gcc
export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_RUNNER="qemu-aarch64 -L /usr/aarch64-linux-gnu"
# Release: the emulated tests run ~20x slower than native ones.
# The Metal emulator needs a C++ compiler for the target, which this cross
# build lacks: tests/metal.rs notes the skip here (TINYVLLM_METAL_REQUIRED=0);
# the native x86-64 run in .ci/run executes them.
TINYVLLM_METAL_REQUIRED=0 cargo test --release --target "$target" -p tinyvllm-kernels
