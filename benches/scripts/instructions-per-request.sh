#!/usr/bin/env bash
# Instructions per request of a kvgate binary under load, counted by callgrind: a repeatable
# figure for comparing two builds on a noisy machine (wall-clock ratios move by ±10% between
# runs; this moves by well under 1%). nginx (one worker, a fixed JSON answer) is the upstream and
# wrk the load; instrumentation is switched on only after start-up and a warm-up, and the count
# covers exactly the measured wrk run (plus the gateway's background probes in that time).
#
#   sudo apt-get install -y valgrind nginx wrk
#   cargo build --release -p kvgate
#   benches/scripts/instructions-per-request.sh target/release/kvgate [seconds] [connections]
#
# KIND=stream answers a streamed request with 16 token events and [DONE] in one body (the
# case of a worker that flushed several events at once).
#
# CLUSTER=1 runs the gateway as one of two replicas over a nats-server of its own
# (docs/replicas.md; `apt-get install -y nats-server`): the measured one takes the load, its
# peer (not under callgrind) is idle. The count then includes the cluster task's work in the
# run (publishing every change of the bookings, applying the peer's heartbeats).
#
# Prints the requests served, the instructions counted, and their ratio; leaves the callgrind
# profile in $OUT (default: a temporary directory) for `callgrind_annotate`.
set -euo pipefail
BIN=$(realpath "${1:?usage: $0 <kvgate binary> [seconds] [connections]}")
SECS=${2:-10}
CONNS=${3:-16}
OUT=${OUT:-$(mktemp -d)}
KIND=${KIND:-unary}
. "$(dirname "$0")/fixed-upstream.sh"
needs "apt-get install -y valgrind nginx wrk curl" valgrind callgrind_control nginx wrk curl python3
cleanup() {
    kill "${KV:-}" "${PEER:-}" "${NATS:-}" 2>/dev/null || true
    [ -f "$OUT/upstream.pid" ] && kill "$(cat "$OUT/upstream.pid")" 2>/dev/null || true
}
trap cleanup EXIT
if [ "${CLUSTER:-0}" = 1 ]; then
    needs "apt-get install -y nats-server" nats-server
    NATS_PORT=$(reserved_port)
    nats-server -a 127.0.0.1 -p "$NATS_PORT" -js -sd "$OUT/js" -l "$OUT/nats.log" &
    NATS=$!
    for _ in $(seq 100); do (exec 3<>"/dev/tcp/127.0.0.1/$NATS_PORT") 2>/dev/null && break; sleep 0.1; done
    KVGATE_EXTRA="cluster:
  nats_url: nats://127.0.0.1:$NATS_PORT
  replica: measured"
fi
# kvgate sets its allocator's purge delay by running itself again (exec), which valgrind does
# not follow: set it here, as kvgate would, so the measured process is the gateway itself.
export MIMALLOC_PURGE_DELAY=${MIMALLOC_PURGE_DELAY:-0}
KVGATE_WRAP="valgrind --tool=callgrind --callgrind-out-file=$OUT/callgrind.out --instr-atstart=no"
start_comparison "$BIN" no-nginx
VG=$KV
if [ "${CLUSTER:-0}" = 1 ]; then
    sed 's/replica: measured/replica: peer/' "$OUT/kvgate.yaml" >"$OUT/peer.yaml"
    "$BIN" --config "$OUT/peer.yaml" --ports-file "$OUT/peer.ports" >"$OUT/peer.log" 2>&1 &
    PEER=$!
fi
URL=http://127.0.0.1:$GW/v1/completions
wait_ready "$URL"
wrk -t1 -c"$CONNS" -d2s -s "$OUT/post.lua" "$URL" >/dev/null
callgrind_control -i on "$VG" >/dev/null 2>&1
RUN=$(wrk -t1 -c"$CONNS" -d"${SECS}s" -s "$OUT/post.lua" "$URL")
callgrind_control -d "$VG" >/dev/null 2>&1
N=$(awk '/requests in/ {print $1}' <<<"$RUN")
IR=$(grep -h '^summary:' "$OUT"/callgrind.out* | awk '{s += $2} END {print s}')
echo "requests $N  instructions $IR  per request $((IR / N))  (profile: $OUT)"
