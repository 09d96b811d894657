#!/usr/bin/env bash
# The real-vLLM suite: installs real vLLM if needed, starts TWO servers on free ports, runs every
# test target that supports an external vLLM target against the first (serially: they share
# the server), the migration tests against both, and last the failover test that kills the
# second. Exit status is the tests' status.
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
start_server() { # PORT ZPORT LOG → prints the pid
  bash "$here/run.sh" "$1" "$2" > "$3" 2>&1 &
  echo $!
}
wait_healthy() { # PORT PID LOG
  for i in $(seq 1 300); do
    if curl -sf "http://127.0.0.1:$1/health" >/dev/null; then echo "real vLLM on :$1 is up after ${i}s"; return 0; fi
    if ! kill -0 "$2" 2>/dev/null; then echo "real vLLM on :$1 exited during start-up:"; tail -50 "$3"; return 1; fi
    sleep 1
  done
  echo "real vLLM on :$1 not healthy after 300 s"; tail -50 "$3"; return 1
}
port=$(free_port); zport=$(free_pair)
log=$(mktemp -t real-vllm.XXXXXX.log)
echo "starting real vLLM on :$port (events :$zport, replay :$((zport+1))), log $log"
pid=$(start_server "$port" "$zport" "$log")
port2=$(free_port); zport2=$(free_pair)
while [ "$port2" = "$port" ] || [ "$zport2" = "$zport" ] || [ "$zport2" = "$((zport+1))" ] || [ "$((zport2+1))" = "$zport" ]; do port2=$(free_port); zport2=$(free_pair); done
log2=$(mktemp -t real-vllm.XXXXXX.log)
echo "starting a second real vLLM on :$port2 (events :$zport2), log $log2"
pid2=$(start_server "$port2" "$zport2" "$log2")
cleanup() {
  for p in "$pid" "$pid2"; do kill "$p" 2>/dev/null || true; pkill -P "$p" 2>/dev/null || true; done
  # The engine processes (renamed "VLLM::EngineCore", "VLLM::Worker") outlive a server killed
  # with -9, and are not children of the shell; they hold the model's memory and CPU.
  pkill -f "tiny-llama" 2>/dev/null || true
  pkill -f "VLLM::" 2>/dev/null || true
  wait 2>/dev/null || true
}
trap cleanup EXIT
wait_healthy "$port" "$pid" "$log"
wait_healthy "$port2" "$pid2" "$log2"

export KVGATE_TARGET_URL="http://127.0.0.1:$port" KVGATE_TARGET_MODEL=tiny KVGATE_TARGET_TOPIC=kv \
       KVGATE_TARGET_ZMQ="tcp://127.0.0.1:$zport" KVGATE_TARGET_REPLAY="tcp://127.0.0.1:$((zport+1))"
cd "$root"
cargo test -p kvgate-tests --test conformance --test gateway --test kv_index -- --test-threads=1
# Two servers: moves between them, then the test that kills the second one (last: it is gone after).
export KVGATE_TARGET_URL_2="http://127.0.0.1:$port2"
cargo test -p kvgate-tests --test migration -- --test-threads=1 --skip a_real_vllm_server_killed
KVGATE_TARGET_PID_2="$pid2" cargo test -p kvgate-tests --test migration -- --test-threads=1 a_real_vllm_server_killed
