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
# Prints the requests served, the instructions counted, and their ratio; leaves the callgrind
# profile in $OUT (default: a temporary directory) for `callgrind_annotate`.
set -euo pipefail
BIN=$(realpath "${1:?usage: $0 <kvgate binary> [seconds] [connections]}")
SECS=${2:-10}
CONNS=${3:-16}
OUT=${OUT:-$(mktemp -d)}
KIND=${KIND:-unary}
for tool in valgrind callgrind_control nginx wrk curl python3; do
    command -v "$tool" >/dev/null || { echo "needs $tool (apt-get install -y valgrind nginx wrk curl)" >&2; exit 2; }
done
read -r UP GW ADMIN < <(python3 -c 'import socket
s=[socket.socket() for _ in range(3)]
[x.bind(("127.0.0.1",0)) for x in s]
print(*[x.getsockname()[1] for x in s])')
if [ "$KIND" = stream ]; then
    TYPE=text/event-stream
    ANSWER=$(for i in $(seq 16); do printf 'data: {"id":"cmpl-1","object":"text_completion","created":1,"model":"m","choices":[{"index":0,"text":" t%d","logprobs":null,"finish_reason":null}]}\n\n' "$i"; done; printf 'data: [DONE]\n\n')
    STREAM=true
else
    TYPE=application/json
    ANSWER='{"id":"cmpl-1","object":"text_completion","created":1,"model":"m","choices":[{"index":0,"text":" ok","finish_reason":"length"}],"usage":{"prompt_tokens":40,"completion_tokens":1,"total_tokens":41}}'
    STREAM=false
fi
cat >"$OUT/nginx.conf" <<CONF
worker_processes 1;
pid $OUT/nginx.pid;
error_log $OUT/nginx-error.log;
events { worker_connections 1024; }
http {
  access_log off;
  server {
    listen 127.0.0.1:$UP;
    location / {
      default_type $TYPE;
      return 200 '$ANSWER';
    }
  }
}
CONF
cat >"$OUT/kvgate.yaml" <<CONF
listen: 127.0.0.1:$GW
admin_listen: 127.0.0.1:$ADMIN
models:
  - name: m
    routing:
      mode: round_robin
    workers:
      - url: http://127.0.0.1:$UP
CONF
cat >"$OUT/post.lua" <<LUA
wrk.method = "POST"
wrk.body = '{"model":"m","prompt":"You are a helpful assistant. Summarize the following report in three sentences, keeping every figure: the gateway forwarded the request to the worker that already held most of its prompt in its KV cache.","max_tokens":16,"stream":$STREAM}'
wrk.headers["Content-Type"] = "application/json"
LUA
nginx -c "$OUT/nginx.conf"
valgrind --tool=callgrind --callgrind-out-file="$OUT/callgrind.out" --instr-atstart=no "$BIN" --config "$OUT/kvgate.yaml" >"$OUT/kvgate.log" 2>&1 &
VG=$!
cleanup() { kill "$VG" 2>/dev/null || true; kill "$(cat "$OUT/nginx.pid")" 2>/dev/null || true; }
trap cleanup EXIT
URL=http://127.0.0.1:$GW/v1/completions
for _ in $(seq 300); do
    curl -s -o /dev/null -XPOST -H 'content-type: application/json' -d '{"model":"m","prompt":"x","max_tokens":1}' "$URL" && break
    sleep 0.2
done
wrk -t1 -c"$CONNS" -d2s -s "$OUT/post.lua" "$URL" >/dev/null
callgrind_control -i on "$VG" >/dev/null 2>&1
RUN=$(wrk -t1 -c"$CONNS" -d"${SECS}s" -s "$OUT/post.lua" "$URL")
callgrind_control -d "$VG" >/dev/null 2>&1
N=$(awk '/requests in/ {print $1}' <<<"$RUN")
IR=$(grep -h '^summary:' "$OUT"/callgrind.out* | awk '{s += $2} END {print s}')
echo "requests $N  instructions $IR  per request $((IR / N))  (profile: $OUT)"
