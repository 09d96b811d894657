#!/usr/bin/env bash
# Serves the tiny model with real vLLM (CPU): prefix caching on, KV events on ZMQ (PUB on
# ZMQ_PORT, replay ROUTER on ZMQ_PORT+1, topic "kv"), dev endpoints (/reset_prefix_cache) on.
#   tests/real-vllm/run.sh PORT ZMQ_PORT [extra vllm args...]
# Model name "tiny"; block size 32 (the CPU attention backend needs a multiple of 32).
# Served in float32, not the weights' bfloat16: the tests compare a greedy stream moved to the
# other server with the unmoved one, and in bfloat16 the destination's prefill of the prompt and
# the tokens so far rounds differently from the source's decode, often enough to pick another
# token at a near-tie (seen with vLLM alone, no gateway between); float32's rounding is too fine
# for the tiny model's ties.
# Start-up takes 60-90 s on 2 cores; poll GET /health.
set -euo pipefail
home=${KVGATE_VLLM_HOME:-$HOME/.cache/kvgate-real-vllm}
port=$1; zport=$2; shift 2
# --max-model-len 4096 (the model's own limit): the kill test needs streams long enough (3,900
# tokens, over ten seconds here) to be killed mid-way.
export HF_HUB_OFFLINE=1 VLLM_SERVER_DEV_MODE=1 VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}
# vLLM's CPU engine keeps its cores busy while it generates; on a small machine the gateway and
# the tests beside it then get no CPU for seconds (seen: a 17 s stall of every other process on
# 2 cores), unlike production, where vLLM has machines of its own. So the servers run on the
# upper half of the cores (the last one on 2 cores); KVGATE_VLLM_CPUS overrides (a taskset list).
n=$(nproc)
cpus=${KVGATE_VLLM_CPUS:-$(( n / 2 ))-$(( n - 1 ))}
[ "$n" -le 1 ] && cpus=${KVGATE_VLLM_CPUS:-0}
export VLLM_CPU_OMP_THREADS_BIND=$cpus
pin=(taskset -c "$cpus")
command -v taskset >/dev/null || pin=()
exec "${pin[@]}" "$home/venv/bin/python" -m vllm.entrypoints.openai.api_server --model "$home/tiny-llama" \
  --host 127.0.0.1 --port "$port" --served-model-name tiny --max-model-len 4096 --block-size 32 --dtype float32 \
  --kv-events-config "{\"enable_kv_cache_events\":true,\"publisher\":\"zmq\",\"endpoint\":\"tcp://*:$zport\",\"replay_endpoint\":\"tcp://*:$((zport+1))\",\"topic\":\"kv\"}" \
  "$@"
