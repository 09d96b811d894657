#!/usr/bin/env bash
# The project's whole test suite, as CI runs it:
#   1. formatting (rustfmt.toml) and clippy with every warning denied;
#   2. every crate's unit and integration tests (vllm-sim workers in-process, ephemeral ports),
#      among them the import-circle check (tests/architecture/);
#   2a. the metrics reference, the dashboard and rules against a real Prometheus, the
#       Kubernetes manifests (tests/observability/, tests/deploy/);
#   2b. every fuzz target (fuzz/, docs/fuzzing.md) for FUZZ_SECONDS (15) on its seeds
#       (tests/fuzz-smoke.sh: installs the nightly toolchain and cargo-fuzz on first use);
#   3. the real-vLLM suite (tests/real-vllm/run-suite.sh: installs the CPU build of vLLM and a
#      tiny model on first use, ~6 GiB, then runs the conformance suite against it).
# KVGATE_SKIP_REAL_VLLM=1 skips step 3 and KVGATE_SKIP_FUZZ=1 step 2b, for a quick local run.
# Each test binary's start is stamped as it begins and its time printed as it ends, with a table
# of all of them, slowest first, at the end: a slow binary shows, and a hanging one is the last
# one started.
set -euo pipefail
cd "$(dirname "$0")/.."

# Passes cargo test's output through, timing each test binary from its "Running" line to its
# "test result" line.
timed() {
  local name="" start=0 now line
  local times=()
  while IFS= read -r line; do
    printf '%s\n' "$line"
    case "$line" in
      *"Running "*)
        name=${line#*Running }
        start=$(date +%s%N)
        echo "[$(date +%T)] test binary started: $name"
        ;;
      "test result: "*)
        now=$(date +%s%N)
        times+=("$(( (now - start) / 1000000 )) $name")
        echo "[$(date +%T)] test binary took $(( (now - start) / 1000000 )) ms: $name"
        ;;
    esac
  done
  echo "test binaries by time (ms):"
  printf '%s\n' "${times[@]}" | sort -rn | awk '{ t = $1; $1 = ""; printf "%9d %s\n", t, $0 }'
}

cargo fmt --all -- --check
cargo clippy --workspace --all-targets -- -D warnings
suite_start=$(date +%s)
cargo test --workspace --all-targets 2>&1 | timed
echo "cargo test took $(( $(date +%s) - suite_start )) s"
# The operator's kit: docs/metrics.md against the code; the dashboard and alert rules against a
# real Prometheus scraping kvgate under load (promtool checks and unit tests first); the
# Kubernetes overlays rendered and validated (tests/deploy/check.sh installs kubectl and the
# validators into a virtualenv of its own on first use).
cargo build -p kvgate --bin kvgate -p vllm-sim --bin vllm-sim
bash tests/observability/metrics-reference.sh
bash tests/observability/prometheus.sh
KVGATE_BIN="${CARGO_TARGET_DIR:-target}/debug/kvgate" bash tests/deploy/check.sh
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
