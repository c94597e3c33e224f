#!/bin/sh
# Installs the release binaries where the service files run them:
# deploy/launchd/*.plist and deploy/systemd/*.service start
# /usr/local/bin/tinyvllm-coordinator and /usr/local/bin/tinyvllm-worker
# (tests/tests/deploy_files.rs checks that they agree with BIN_DIR below).
# Builds them first if they are missing. Uses sudo when BIN_DIR is not
# writable (Apple Silicon Macs may not even have /usr/local/bin yet).
#
#   tools/install.sh                 # build if needed, install to /usr/local/bin
#   BIN_DIR=~/bin tools/install.sh   # elsewhere (then edit the service files)
set -eu
cd "$(dirname "$0")/.."
BIN_DIR="${BIN_DIR:-/usr/local/bin}"
BINS="target/release/tinyvllm-coordinator target/release/tinyvllm-worker"
for bin in $BINS; do
    [ -x "$bin" ] || { cargo build --release --bins; break; }
done
SUDO=""
if ! { [ -d "$BIN_DIR" ] && [ -w "$BIN_DIR" ]; } && [ "$(id -u)" != 0 ]; then
    SUDO="sudo"
fi
$SUDO install -d "$BIN_DIR"
# shellcheck disable=SC2086 # two paths without spaces
$SUDO install -m 755 $BINS "$BIN_DIR/"
echo "installed tinyvllm-coordinator and tinyvllm-worker in $BIN_DIR"
