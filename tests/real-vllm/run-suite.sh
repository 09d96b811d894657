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

# Ports come from below the kernel's ephemeral range (ip_local_port_range, 32768+ by default):
# vLLM binds the KV-event ports a minute after they are picked, and in between its own internal
# sockets (and every outgoing connection) take ephemeral ports, so a port picked from that range
# can be gone by then and the engine core dies on start-up ("Address already in use").
# Each pick is a run of three free ports: HTTP, events, replay (events + 1).
taken=""
pick_ports() {
  python3 - "$taken" <<'PY'
import random, socket, sys
taken = set(int(p) for p in sys.argv[1].split())
lo = 20000
hi = min(32000, int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0]) - 3)
for _ in range(500):
    p = random.randrange(lo, hi)
    if {p, p + 1, p + 2} & taken:
        continue
    socks = []
    try:
        for q in (p, p + 1, p + 2):
            s = socket.socket(); s.bind(("127.0.0.1", q)); socks.append(s)
        print(p); break
    except OSError:
        pass
    finally:
        for s in socks: s.close()
else:
    sys.exit("no three consecutive free ports below the ephemeral range")
PY
}
suite_flags=(--enable-scale-out --enable-lora --max-lora-rank 8)
start_server() { # PORT LOG [EXTRA VLLM ARGS] → starts real vLLM (events on PORT+1, replay PORT+2), prints the pid
  # Its own process group (setsid: the pid is the group's id), so cleanup ends exactly the
  # processes it started, engine cores included. The response store and the /render endpoints
  # are on for the drop-in tests (#34). LoRA is enabled on both, adapters or not: a LoRA-enabled
  # CPU engine computes the base model slightly differently (greedy outputs differ after a few
  # tokens), and the tests compare the two servers' outputs.
  local p=$1 log=$2; shift 2
  VLLM_ENABLE_RESPONSES_API_STORE=1 setsid bash "$here/run.sh" "$p" "$((p + 1))" "${suite_flags[@]}" "$@" > "$log" 2>&1 &
  echo $!
}
wait_healthy() { # PORT PID LOG → 0 up, 1 exited during start-up, 2 not up in time
  for i in $(seq 1 300); do
    if curl -sf "http://127.0.0.1:$1/health" >/dev/null; then echo "real vLLM on :$1 is up after ${i}s"; return 0; fi
    if ! kill -0 "$2" 2>/dev/null; then
      echo "real vLLM on :$1 exited during start-up; the errors in its log ($3):"
      grep -n -E "Error|error:|Exception|Traceback" "$3" | grep -v "^.*File \"" | head -20 || true
      echo "... and its last lines:"; tail -15 "$3"
      return 1
    fi
    sleep 1
  done
  echo "real vLLM on :$1 not healthy after 300 s"; tail -50 "$3"; return 2
}
# Starts one server and waits for it; a server that dies during start-up is started once more on
# fresh ports, as a second failure in a row is a real one. Sets $port and $pid.
launch() { # LOG [EXTRA VLLM ARGS]
  local attempt log=$1; shift
  for attempt in 1 2; do
    port=$(pick_ports); taken="$taken $port $((port+1)) $((port+2))"
    echo "starting real vLLM on :$port (events :$((port+1)), replay :$((port+2))), log $log $*"
    pid=$(start_server "$port" "$log" "$@")
    pids="$pids $pid"
    local rc=0; wait_healthy "$port" "$pid" "$log" || rc=$?
    [ "$rc" = 0 ] && return 0
    [ "$rc" = 1 ] && [ "$attempt" = 1 ] && { echo "starting it again on other ports"; continue; }
    return 1
  done
}
pids=""
cleanup() {
  # Each server's whole process group: the API server and its engine core processes (which
  # outlive an API server killed with -9), and nothing this script did not start.
  for p in $pids; do kill -TERM -- "-$p" 2>/dev/null || true; done
  sleep 2
  for p in $pids; do kill -KILL -- "-$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
}
trap cleanup EXIT
# The OTLP receiver the first server and the traces tests' kvgate both export to (tests/traces:
# vLLM's spans under kvgate's leg, in one trace).
otlp_dir=$(mktemp -d -t kvgate-otlp.XXXXXX)
setsid "${KVGATE_VLLM_HOME:-$HOME/.cache/kvgate-real-vllm}/venv/bin/python" "$here/otlp_receiver.py" "$otlp_dir/port" "$otlp_dir/spans.jsonl" > "$otlp_dir/receiver.log" 2>&1 &
pids="$pids $!"
for _ in $(seq 1 100); do [ -s "$otlp_dir/port" ] && break; sleep 0.1; done
[ -s "$otlp_dir/port" ] || { echo "the OTLP receiver did not start:"; cat "$otlp_dir/receiver.log"; exit 1; }
otlp_url="http://127.0.0.1:$(cat "$otlp_dir/port")"
# The two start one after the other: on 2 cores two concurrent start-ups take as long as two
# serial ones, and a failure is then attributable to one server. The first exports its traces.
OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf launch "$(mktemp -t real-vllm.XXXXXX.log)" --otlp-traces-endpoint "$otlp_url/v1/traces"; port1=$port; pid1=$pid
# The second serves the tiny LoRA adapter setup.sh made, so the fleet test sees an adapter on
# one worker only (#34).
lora_dir="${KVGATE_VLLM_HOME:-$HOME/.cache/kvgate-real-vllm}/tiny-lora"
launch "$(mktemp -t real-vllm.XXXXXX.log)" --lora-modules "tiny-lora=$lora_dir"; port2=$port; pid2=$pid
port=$port1; zport=$((port1 + 1))

# The tokenizer folder lets the conformance suite compare kvgate's rendering with vLLM's /render.
export KVGATE_TARGET_TOKENIZER="${KVGATE_VLLM_HOME:-$HOME/.cache/kvgate-real-vllm}/tiny-llama"
export KVGATE_TARGET_URL="http://127.0.0.1:$port" KVGATE_TARGET_MODEL=tiny KVGATE_TARGET_TOPIC=kv \
       KVGATE_TARGET_ZMQ="tcp://127.0.0.1:$zport" KVGATE_TARGET_REPLAY="tcp://127.0.0.1:$((zport+1))"
cd "$root"
# The second server is named for the drop-in test that needs two (stored responses' affinity);
# the venv's Python runs the Anthropic and OpenAI SDKs (drop-in, and their retries on a tenant's 429).
KVGATE_TARGET_URL_2="http://127.0.0.1:$port2" KVGATE_TARGET_LORA=tiny-lora KVGATE_VLLM_PYTHON="${KVGATE_VLLM_HOME:-$HOME/.cache/kvgate-real-vllm}/venv/bin/python" \
  KVGATE_OTLP_URL="$otlp_url" KVGATE_OTLP_SPANS="$otlp_dir/spans.jsonl" \
  cargo test -p kvgate-tests --test conformance --test gateway --test kv_index --test tenants --test traces -- --test-threads=1
# Two servers: moves between them, then the test that kills the second one (last: it is gone after).
export KVGATE_TARGET_URL_2="http://127.0.0.1:$port2"
cargo test -p kvgate-tests --test migration -- --test-threads=1 --skip a_real_vllm_server_killed
# Replicas over a real nats-server: a stored response's next turn, sent to another replica, lands
# on the worker that stored it.
cargo test -p kvgate-tests --test replicas -- --test-threads=1 a_stored_responses_next_turn
# The kill test kills the second server's process group (its pid is the group's id).
KVGATE_TARGET_PID_2="$pid2" cargo test -p kvgate-tests --test migration -- --test-threads=1 a_real_vllm_server_killed
# The planner's local connector starts a real vLLM from run.sh (the second server is gone, so
# two still fit) and stops it after its streams moved to the first (#35).
KVGATE_VLLM_RUN="$here/run.sh" cargo test -p kvgate-tests --test planner -- --test-threads=1 a_real_vllm_worker
# Prefill/decode disaggregation (#38) on a KV connector that runs on CPU: NIXL is not installed
# here, and vLLM's ExampleConnector shares KV through a directory (docs/disaggregation.md has its
# limits: only the first prefill chunk is saved, hence --max-num-batched-tokens 4096, the model's
# whole context). The first server stops so that two fit; two plain servers with the connector
# start, and kvgate runs the two legs across them.
kill -TERM -- "-$pid1" 2>/dev/null || true
for _ in $(seq 1 40); do kill -0 -- "-$pid1" 2>/dev/null || break; sleep 0.25; done
kill -KILL -- "-$pid1" 2>/dev/null || true
pd_store=$(mktemp -d -t kvgate-pd.XXXXXX)
trap 'cleanup; rm -rf "$pd_store" "$otlp_dir"' EXIT
suite_flags=(--max-num-batched-tokens 4096)
kv_cfg="{\"kv_connector\":\"ExampleConnector\",\"kv_role\":\"kv_both\",\"kv_connector_extra_config\":{\"shared_storage_path\":\"$pd_store\"}}"
launch "$(mktemp -t real-vllm.XXXXXX.log)" --kv-transfer-config "$kv_cfg"; pd1=$port
launch "$(mktemp -t real-vllm.XXXXXX.log)" --kv-transfer-config "$kv_cfg"; pd2=$port
KVGATE_PD_URLS="http://127.0.0.1:$pd1,http://127.0.0.1:$pd2" cargo test -p kvgate-tests --test gateway -- --test-threads=1 disagg::real_vllm
