#!/usr/bin/env bash
# No import circles: in each crate below, no module uses one that (through any others) uses it
# back. The graph is cargo-modules' (rust-analyzer's name resolution: a re-export counts where
# it is written, an item where it is defined); tests/module_cycles.py finds the circles in it.
# Installs cargo-modules on first use (0.27: the last release this toolchain builds).
set -euo pipefail
cd "$(dirname "$0")/.."
command -v cargo-modules >/dev/null || cargo install cargo-modules --version 0.27.0 --locked
status=0
for crate in kvgate vllm-sim; do
  dot="$(mktemp -t "modules-$crate.XXXXXX.dot")"
  cargo modules dependencies --lib -p "$crate" --no-externs --no-sysroot > "$dot"
  echo "== $crate"
  python3 tests/module_cycles.py < "$dot" || status=1
  rm -f "$dot"
done
exit "$status"
