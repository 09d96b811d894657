#!/usr/bin/env bash
# The real-vLLM suite: installs real vLLM if needed, starts ONE server on free ports, runs every
# test target that supports an external vLLM target against it (serially: they share the
# server), then stops it. Exit status is the tests' status.
#   tests/real-vllm/run-suite.sh
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
bash "$here/setup.sh"

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
# The replay endpoint is ZMQ_PORT+1, so look for two consecutive free ports.
free_pair() {
  python3 - <<'PY'
import socket
for _ in range(200):
    a = socket.socket(); a.bind(("127.0.0.1", 0)); p = a.getsockname()[1]
    b = socket.socket()
    try:
        b.bind(("127.0.0.1", p + 1)); print(p); break
    except OSError:
        pass
    finally:
        a.close(); b.close()
PY
}
port=$(free_port); zport=$(free_pair)
log=$(mktemp -t real-vllm.XXXXXX.log)
echo "starting real vLLM on :$port (events :$zport, replay :$((zport+1))), log $log"
bash "$here/run.sh" "$port" "$zport" > "$log" 2>&1 &
pid=$!
cleanup() { kill "$pid" 2>/dev/null || true; pkill -P "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true; }
trap cleanup EXIT
for i in $(seq 1 300); do
  if curl -sf "http://127.0.0.1:$port/health" >/dev/null; then break; fi
  if ! kill -0 "$pid" 2>/dev/null; then echo "real vLLM exited during start-up:"; tail -50 "$log"; exit 1; fi
  sleep 1
done
curl -sf "http://127.0.0.1:$port/health" >/dev/null || { echo "real vLLM not healthy after 300 s"; tail -50 "$log"; exit 1; }
echo "real vLLM is up after ${i}s"

export KVGATE_TARGET_URL="http://127.0.0.1:$port" KVGATE_TARGET_MODEL=tiny KVGATE_TARGET_TOPIC=kv \
       KVGATE_TARGET_ZMQ="tcp://127.0.0.1:$zport" KVGATE_TARGET_REPLAY="tcp://127.0.0.1:$((zport+1))"
cd "$root"
cargo test -p kvgate-tests --test conformance --test gateway --test kv_index -- --test-threads=1
