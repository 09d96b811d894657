#!/usr/bin/env bash
# What one proxied unary request costs the proxy, kvgate against nginx, under the same load:
# CPU time (and the kernel's share of it, from perf samples), context switches, syscalls and
# TCP segments per request. It answers "is the gap in kvgate's code or in the kernel?" where
# wall-clock ratios on a shared 2-core machine cannot.
#
# nginx (one worker, a fixed JSON answer) is the upstream of both proxies: nginx as a reverse
# proxy (one worker, keep-alive upstream pool, buffering off) and kvgate (round_robin). wrk (one
# thread) drives each in turn for the same time. KIND=stream measures 16-event streams instead.
# FLOOR=<floor-proxy binary> adds the floor of a tokio proxy (benches/src/bin/floor_proxy.rs):
# the least any HTTP/1 forwarder on tokio spends here, so the gap to nginx splits into what is
# the runtime's and what is the gateway's.
#
#   sudo apt-get install -y nginx wrk linux-perf
#   cargo build --release -p kvgate -p kvgate-bench
#   FLOOR=target/release/floor-proxy benches/scripts/cost-per-request.sh target/release/kvgate [seconds] [connections] [threads]
#
# Needs perf with access to tracepoints (root, or kernel.perf_event_paranoid <= -1).
set -euo pipefail
BIN=$(realpath "${1:?usage: $0 <kvgate binary> [seconds] [connections] [kvgate threads]}")
SECS=${2:-5}
CONNS=${3:-64}
THREADS=${4:-}
OUT=${OUT:-$(mktemp -d)}
. "$(dirname "$0")/fixed-upstream.sh"
needs "apt-get install -y nginx wrk linux-perf iproute2 curl" nginx wrk perf nstat curl python3
FP=
cleanup() {
    kill "${KV:-}" $FP 2>/dev/null || true
    for pid in "$OUT/upstream.pid" "$OUT/nginx.pid"; do [ -f "$pid" ] && kill "$(cat "$pid")" 2>/dev/null || true; done
}
trap cleanup EXIT
KVGATE_EXTRA="${THREADS:+threads: $THREADS}"
start_comparison "$BIN"
if [ -n "${FLOOR:-}" ]; then
    # The floor proxy binds port 0 too and writes the port it got.
    "$(realpath "$FLOOR")" --listen 127.0.0.1:0 --upstream "127.0.0.1:$UP" ${THREADS:+--threads "$THREADS"} --ports-file "$OUT/floor.ports" >"$OUT/floor.log" 2>&1 &
    FP=$!
    FL=$(ports_from_file "$OUT/floor.ports" "$FP" "$OUT/floor.log" listen)
fi
wait_ready "http://127.0.0.1:$GW/v1/completions"

# One measured run against a proxy whose processes are $2 (comma-separated pids).
measure() {
    local name=$1 pids=$2 url=$3
    wrk -t1 -c"$CONNS" -d2s -s "$OUT/post.lua" "$url" >/dev/null
    nstat -n
    perf stat -x, -e task-clock,context-switches,raw_syscalls:sys_enter -p "$pids" -o "$OUT/$name.stat" -- sleep "$SECS" &
    local stat=$!
    perf record -q -F 999 -o "$OUT/$name.perf" -p "$pids" -- sleep "$SECS" >/dev/null 2>&1 &
    local rec=$!
    local run
    run=$(wrk -t1 -c"$CONNS" -d"${SECS}s" -s "$OUT/post.lua" "$url")
    wait "$stat" "$rec"
    local n segs kernel
    n=$(awk '/requests in/ {print $1}' <<<"$run")
    segs=$(nstat | awk '$1 == "TcpOutSegs" {print $2}')
    kernel=$(perf report -i "$OUT/$name.perf" --sort dso --stdio 2>/dev/null | awk '/\[kernel/ {gsub("%", "", $1); print $1}')
    awk -F, -v name="$name" -v n="$n" -v secs="$SECS" -v segs="$segs" -v kernel="${kernel:-0}" '
        $3 == "task-clock" { cpu = $1 }
        $3 == "context-switches" { cs = $1 }
        $3 == "raw_syscalls:sys_enter" { sc = $1 }
        END {
            us = cpu * 1000 / n
            printf "| %s | %.0f | %.1f | %.1f (%.0f%%) | %.1f | %.3f | %.2f | %.2f |\n", name, n / secs, us, us * kernel / 100, kernel, us * (100 - kernel) / 100, cs / n, sc / n, segs / n
        }' "$OUT/$name.stat"
}

echo "| proxy | req/s | CPU µs/request | of which kernel | user | context switches/request | syscalls/request | TCP segments sent/request (all processes) |"
echo "|---|---:|---:|---:|---:|---:|---:|---:|"
NGINX_PIDS="$(cat "$OUT/nginx.pid"),$(pgrep -P "$(cat "$OUT/nginx.pid")" | paste -sd,)"
measure nginx "$NGINX_PIDS" "http://127.0.0.1:$NG/v1/completions"
measure kvgate "$KV" "http://127.0.0.1:$GW/v1/completions"
if [ -n "$FP" ]; then
    wait_ready "http://127.0.0.1:$FL/v1/completions"
    measure floor "$FP" "http://127.0.0.1:$FL/v1/completions"
fi
echo "(profiles and logs: $OUT)"
