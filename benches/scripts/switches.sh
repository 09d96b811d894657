#!/usr/bin/env bash
# Why a proxy's threads leave the CPU under load: every context switch of kvgate (and, with
# WITH_NGINX=1, of an nginx reverse proxy's worker in the same setup, after it) during a wrk
# run, classified by its `prev_state` and its stack (not NGINX=1: nginx itself reads that
# variable, for sockets inherited across a binary upgrade). A switch whose thread was still
# runnable is a preemption; a sleeping one is named by its frames: asleep in epoll_wait (idle), a tokio worker parked on
# its condvar, or waiting for a parking_lot lock (contention). It answers "do the gateway's
# threads wait on each other's locks, or get preempted more?" where CPU time cannot.
#
# The setup is cost-per-request.sh's: nginx (one worker, a fixed JSON answer) as the upstream,
# kvgate round_robin in front of it, wrk (one thread) as the load.
#
#   sudo apt-get install -y nginx wrk linux-perf
#   cargo build --release -p kvgate
#   WITH_NGINX=1 benches/scripts/switches.sh target/release/kvgate [seconds] [connections] [kvgate threads]
#
# Needs perf with tracepoints and DWARF unwinding (root, or kernel.perf_event_paranoid <= -1),
# and a binary with debug info (the release profile keeps it). The recording is large (about
# 200 MB a second at 45k requests/s); it is classified and deleted.
set -euo pipefail
BIN=$(realpath "${1:?usage: $0 <kvgate binary> [seconds] [connections] [kvgate threads]}")
SECS=${2:-3}
CONNS=${3:-64}
THREADS=${4:-}
OUT=${OUT:-$(mktemp -d)}
. "$(dirname "$0")/fixed-upstream.sh"
needs "apt-get install -y nginx wrk linux-perf curl" nginx wrk perf curl python3
cleanup() {
    kill "${KV:-}" 2>/dev/null || true
    for pid in "$OUT/upstream.pid" "$OUT/nginx.pid"; do [ -f "$pid" ] && kill "$(cat "$pid")" 2>/dev/null || true; done
    rm -f "$OUT/switches.data"
}
trap cleanup EXIT
KVGATE_EXTRA="${THREADS:+threads: $THREADS}"
start_comparison "$BIN" "$([ -n "${WITH_NGINX:-}" ] && echo with || echo no-nginx)"
wait_ready "http://127.0.0.1:$GW/v1/completions"

# Records and classifies the switches of processes $2 (comma-separated pids) under load on $3.
switches() {
    local name=$1 pids=$2 url=$3
    wrk -t1 -c"$CONNS" -d2s -s "$OUT/post.lua" "$url" >/dev/null
    perf record -q -e sched:sched_switch --call-graph dwarf,16384 -o "$OUT/switches.data" -p "$pids" -- sleep "$SECS" >/dev/null 2>&1 &
    local rec=$!
    local run n
    run=$(wrk -t1 -c"$CONNS" -d"${SECS}s" -s "$OUT/post.lua" "$url")
    wait "$rec"
    n=$(awk '/requests in/ {print $1}' <<<"$run")
    perf script -i "$OUT/switches.data" 2>/dev/null | python3 -c '
import collections, re, sys
name, n = sys.argv[1], int(sys.argv[2])
kinds = collections.Counter()
for event in sys.stdin.read().split("\n\n"):
    lines = event.strip().split("\n")
    if not lines or "sched_switch" not in lines[0]:
        continue
    state = re.search(r"prev_state=(\S+)", lines[0])
    stack = "\n".join(lines[1:])
    if state and state.group(1).startswith("R"):
        kind = "preempted while runnable"
    elif "lock_slow" in stack:
        kind = "waiting for a parking_lot lock"
    elif "epoll_wait" in stack:
        kind = "asleep in epoll_wait"
    elif "Condvar" in stack or "futex_wait" in stack:
        kind = "a tokio worker parked"
    else:
        kind = "asleep elsewhere"
    kinds[kind] += 1
total = sum(kinds.values())
print(f"{name}: requests {n}, switches {total} ({total / max(n, 1):.3f} per request)")
for kind, count in kinds.most_common():
    print(f"  {kind}: {count} ({count / max(n, 1):.4f} per request)")
' "$name" "$n"
    rm -f "$OUT/switches.data"
}

switches kvgate "$KV" "http://127.0.0.1:$GW/v1/completions"
if [ -n "${WITH_NGINX:-}" ]; then
    switches nginx "$(pgrep -P "$(cat "$OUT/nginx.pid")" | paste -sd,)" "http://127.0.0.1:$NG/v1/completions"
fi
