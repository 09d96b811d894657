#!/usr/bin/env bash
# Live check of deploy/grafana/kvgate.json and deploy/prometheus/kvgate-rules.yml: vllm-sim
# workers behind two kvgate replicas on a nats-server, a short load, a real Prometheus scraping kvgate's admin /metrics
# every second with the rules loaded, then every panel's query evaluated through its HTTP API
# (tests/observability/live_check.py has the details). Ports are all of the system's choosing.
#
# Needs: python3 (standard library only), prometheus (Debian: apt-get install prometheus;
# the binary is run directly, not the service), and built binaries:
#   KVGATE_BIN   (default target/debug/kvgate:   cargo build -p kvgate --bin kvgate)
#   VLLM_SIM_BIN (default target/debug/vllm-sim: cargo build -p vllm-sim --bin vllm-sim)
#   nats-server on PATH (Debian: apt-get install nats-server; run with -js, on a port of its
#   choosing, its store in the temporary directory)
#   PROMETHEUS_BIN, PROMTOOL_BIN (default: prometheus and promtool on PATH; the rules are
#   checked with `promtool check rules` and `promtool test rules` first)
# KVGATE_OBS_KEEP=1 keeps the temporary directory (logs, configs, the TSDB).
set -euo pipefail
cd "$(dirname "$0")/../.."
target="${CARGO_TARGET_DIR:-target}"
kvgate="${KVGATE_BIN:-$target/debug/kvgate}"
sim="${VLLM_SIM_BIN:-$target/debug/vllm-sim}"
prom="${PROMETHEUS_BIN:-$(command -v prometheus || true)}"
promtool="${PROMTOOL_BIN:-$(command -v promtool || true)}"
nats="$(command -v nats-server || true)"
for b in "$kvgate" "$sim" "$prom" "$promtool" "$nats"; do
  if [[ -z "$b" || ! -x "$b" ]]; then
    echo "FAIL missing binary: ${b:-prometheus, promtool or nats-server} (see the header of $0)"
    echo "0 passed, 1 failed"
    exit 1
  fi
done
exec python3 tests/observability/live_check.py "$kvgate" "$sim" "$prom" "$promtool"
