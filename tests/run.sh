#!/usr/bin/env bash
# The project's whole test suite, as CI runs it:
#   1. formatting (rustfmt.toml) and clippy with every warning denied;
#   2. every crate's unit and integration tests (vllm-sim workers in-process, ephemeral ports);
#   2b. every fuzz target (fuzz/, docs/fuzzing.md) for FUZZ_SECONDS (15) on its seeds
#       (tests/fuzz-smoke.sh: installs the nightly toolchain and cargo-fuzz on first use);
#   3. the real-vLLM suite (tests/real-vllm/run-suite.sh: installs the CPU build of vLLM and a
#      tiny model on first use, ~6 GiB, then runs the conformance suite against it).
# KVGATE_SKIP_REAL_VLLM=1 skips step 3 and KVGATE_SKIP_FUZZ=1 step 2b, for a quick local run.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo fmt --all -- --check
cargo clippy --workspace --all-targets -- -D warnings
cargo test --workspace --all-targets
if [ "${KVGATE_SKIP_FUZZ:-0}" = 1 ]; then
  echo "KVGATE_SKIP_FUZZ=1: fuzz smoke skipped"
else
  FUZZ_SECONDS="${FUZZ_SECONDS:-15}" bash tests/fuzz-smoke.sh
fi
if [ "${KVGATE_SKIP_REAL_VLLM:-0}" = 1 ]; then
  echo "KVGATE_SKIP_REAL_VLLM=1: real-vLLM suite skipped"
else
  bash tests/real-vllm/run-suite.sh
fi
