#!/usr/bin/env bash
# Builds the guest side (SDK, examples, test guests) for wasm32-wasip2 into plugins/target.
# Components land in plugins/target/wasm32-wasip2/release/<crate_name>.wasm.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
rustup target list --installed 2>/dev/null | grep -qx wasm32-wasip2 || rustup target add wasm32-wasip2
# --target-dir: the guests land in plugins/target even when CARGO_TARGET_DIR points elsewhere.
build() { cargo build --release --target wasm32-wasip2 --target-dir "$here/target" --manifest-path "$here/Cargo.toml" "$@"; }
build --workspace --exclude forbidden ${QUIET:+--quiet}
# The std guest on its own: built together, feature unification would give it the no_std
# runtime too (two panic handlers).
build -p forbidden ${QUIET:+--quiet}
