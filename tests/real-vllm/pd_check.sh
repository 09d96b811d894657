#!/usr/bin/env bash
# Prefill/decode disaggregation between two real vLLM (CPU) servers, no gateway involved (issue #38).
#   tests/real-vllm/pd_check.sh        exit 0 when every case passes
# Starts P and D via tests/real-vllm/run.sh, both with vLLM's ExampleConnector (kv_both) on one
# shared directory: the connector writes the KV of a prompt's full blocks to
# <dir>/<hash of those token ids>/<layer>.safetensors when it computes a prompt it has no file for,
# and loads that file when a later prompt's token ids hash to an existing folder. So the P leg
# (max_tokens 1, kv_transfer_params do_remote_decode, as vLLM's toy proxy sends it) writes the
# files and the D leg reads them. Per case it checks: the P response's kv_transfer_params (null for
# this connector), D's vllm:prompt_tokens_by_source_total{source="external_kv_transfer"} grew by the
# expected full-block count, and D's token ids and logprobs equal an aggregated run of the same
# request (computed on D beforehand, storage wiped and prefix cache reset between).
# Takes about 2-3 minutes on 2 cores (start-up of two servers side by side dominates).
# Caveats of ExampleConnector (a debug connector), seen on vLLM 0.32:
# - it saves only the first scheduled prefill chunk: a prompt longer than max_num_batched_tokens
#   (2048 by default here) saves 2048 tokens under the full prompt's hash and the D engine dies
#   loading it ("shape mismatch: value tensor of shape [2048, 1, 128] cannot be broadcast to
#   indexing result of shape [2976, 1, 128]"), so both servers get --max-num-batched-tokens 4096;
# - it saves floor((n-1)/32)*32 tokens but looks up floor((n-2)/32)*32, so a prompt of n tokens
#   with n % 32 == 1 (and any prompt under 34 tokens) never transfers anything.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
home=${KVGATE_VLLM_HOME:-$HOME/.cache/kvgate-real-vllm}
py=$home/venv/bin/python
t0=$(date +%s)
work=$(mktemp -d /tmp/kvgate-pd.XXXXXX)
store=$work/kv logs=$work/logs
mkdir -p "$store" "$logs"
pgids=()
cleanup() {
  local rc=$? g
  for g in "${pgids[@]}"; do kill -- "-$g" 2>/dev/null || true; done
  for g in "${pgids[@]}"; do
    for _ in $(seq 1 40); do kill -0 -- "-$g" 2>/dev/null || break; sleep 0.25; done
    kill -9 -- "-$g" 2>/dev/null || true
  done
  if [ "$rc" = 0 ]; then rm -rf "$work"; else echo "logs kept in $logs"; fi
}
trap cleanup EXIT

# A free port in 20000-31999 whose next two ports (kv-events PUB and replay) are free as well.
free_port() {
  "$py" - <<'EOF'
import random, socket
def free(p):
    s = socket.socket()
    try: s.bind(("127.0.0.1", p)); return True
    except OSError: return False
    finally: s.close()
while True:
    p = random.randrange(20000, 31990, 10)
    if all(free(p + i) for i in range(3)) and all(free(p + 5 + i) for i in range(2)):
        print(p); break
EOF
}
kv_cfg="{\"kv_connector\":\"ExampleConnector\",\"kv_role\":\"kv_both\",\"kv_connector_extra_config\":{\"shared_storage_path\":\"$store\"}}"
start() { # name port -> starts the server in its own process group (setsid) and records the group
  local log=$logs/$1.log
  setsid "$here/run.sh" "$2" "$(( $2 + 5 ))" --kv-transfer-config "$kv_cfg" --max-num-batched-tokens 4096 \
    >"$log" 2>&1 </dev/null &
  local pid=$! g=""
  # setsid makes the child the leader of a new group (pgid == pid); record it only once it is one
  for _ in $(seq 1 50); do
    g=$(ps -o pgid= -p "$pid" | tr -d ' ')
    [ "$g" = "$pid" ] && break
    sleep 0.1
  done
  [ "$g" = "$pid" ] || { echo "FAIL: $1 (pid $pid) did not become a process-group leader"; kill "$pid"; exit 1; }
  pgids+=("$pid")
  echo "started $1 on port $2 (pgid $pid, log $log)"
}
p_port=$(free_port); start P "$p_port"
d_port=$(free_port); while [ "$d_port" = "$p_port" ]; do d_port=$(free_port); done; start D "$d_port"
for name in P D; do
  port=$p_port; [ $name = D ] && port=$d_port
  for i in $(seq 1 120); do
    curl -sf -o /dev/null "http://127.0.0.1:$port/health" && break
    [ "$i" = 120 ] && { echo "FAIL: $name not healthy after 240 s"; tail -n 30 "$logs/$name.log"; exit 1; }
    sleep 2
  done
done
echo "both healthy after $(( $(date +%s) - t0 )) s"

"$py" - "http://127.0.0.1:$p_port" "http://127.0.0.1:$d_port" "$store" <<'EOF'
import json, os, random, re, shutil, sys, time, urllib.request
P, D, store = sys.argv[1:4]
PT = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
      "remote_block_ids": None, "remote_host": None, "remote_port": None}

def post(base, path, body, rid=None):
    h = {"Content-Type": "application/json"}
    if rid: h["X-Request-Id"] = rid
    req = urllib.request.Request(base + path, data=json.dumps(body).encode(), headers=h)
    with urllib.request.urlopen(req, timeout=300) as r:
        return r.read().decode()

def by_source(base):
    txt = urllib.request.urlopen(base + "/metrics", timeout=30).read().decode()
    return {re.search(r'source="([^"]+)"', l).group(1): float(l.split()[-1])
            for l in txt.splitlines() if l.startswith("vllm:prompt_tokens_by_source_total{")}

def settled(base, before, want_total):
    # the counters are updated a little after the response; wait until the request is counted
    for _ in range(50):
        now = by_source(base)
        if sum(now.values()) - sum(before.values()) >= want_total: return now
        time.sleep(0.2)
    return by_source(base)

def parse(raw, chat, stream):
    """-> (text, token ids, [(token, logprob)], prompt tokens)"""
    chunks = [json.loads(l[6:]) for l in raw.splitlines()
              if l.startswith("data: ") and l != "data: [DONE]"] if stream else [json.loads(raw)]
    text, ids, lps, n = "", [], [], None
    for j in chunks:
        if j.get("usage"): n = j["usage"]["prompt_tokens"]
        for c in j.get("choices", []):
            if chat:
                text += (c["delta"] if stream else c["message"]).get("content") or ""
                if c.get("logprobs"): lps += [(t["token"], t["logprob"]) for t in c["logprobs"]["content"]]
            else:
                text += c.get("text") or ""
                if c.get("logprobs"): lps += list(zip(c["logprobs"]["tokens"], c["logprobs"]["token_logprobs"]))
            ids += c.get("token_ids") or []
    return text, ids, lps, n

words = ("the cache router block prefix token worker request stream model server proxy latency "
         "throughput decode prefill system user assistant hello").split()
def prompt(seed, n):
    r = random.Random(seed)
    return " ".join(r.choice(words) for _ in range(n))

def request(chat, text, max_tokens, stream, **kw):
    b = {"model": "tiny", "max_tokens": max_tokens, "temperature": 0, "stream": stream,
         "return_token_ids": True, **kw}
    if stream: b["stream_options"] = {"include_usage": True}
    if chat: b.update(messages=[{"role": "user", "content": text}], logprobs=True, top_logprobs=2)
    else: b.update(prompt=text, logprobs=2)
    return b

def reset(base):
    urllib.request.urlopen(urllib.request.Request(base + "/reset_prefix_cache", method="POST"), timeout=30).read()

def wipe():
    for e in os.listdir(store): shutil.rmtree(os.path.join(store, e))

ok = True
cases = [("chat", False, prompt(1, 300)), ("chat", True, prompt(2, 300)),
         ("completions", False, prompt(3, 300)), ("completions", True, prompt(4, 2500))]
for i, (api, stream, text) in enumerate(cases):
    chat = api == "chat"; path = "/v1/chat/completions" if chat else "/v1/completions"
    name = f"{api} stream={stream}"
    t = time.time()
    # aggregated reference on D, everything computed locally
    wipe(); reset(D)
    b0 = by_source(D)
    ref = parse(post(D, path, request(chat, text, 16, stream)), chat, stream)
    n = ref[3]  # prompt tokens
    b1 = settled(D, b0, n)
    ref_delta = {k: b1[k] - b0[k] for k in b0}
    wipe(); reset(D)
    # prefill leg on P
    rid = f"pd-check-{i}-{int(time.time())}"
    p_raw = post(P, path, request(chat, text, 1, False, kv_transfer_params=PT), rid)
    p_json = json.loads(p_raw)
    files = sorted(f"{d}/{f}" for d in os.listdir(store) for f in os.listdir(os.path.join(store, d)))
    # decode leg on D (with P's kv_transfer_params if it returned any, as the toy proxy does)
    body = request(chat, text, 16, stream)
    if p_json.get("kv_transfer_params"): body["kv_transfer_params"] = p_json["kv_transfer_params"]
    d0 = by_source(D)
    got = parse(post(D, path, body, rid), chat, stream)
    d1 = settled(D, d0, n)
    d_delta = {k: d1[k] - d0[k] for k in d0}
    # what ExampleConnector loads: the full 32-token blocks of the prompt less its last token, and
    # nothing when n % 32 == 1 (it saved under the hash of one block more than it looks up)
    want_ext = 0 if n % 32 == 1 else (n - 2) // 32 * 32
    checks = {
        "reference computed locally": ref_delta["external_kv_transfer"] == 0 and ref_delta["local_compute"] == n,
        "P wrote KV files": len(files) > 0,
        f"D external_kv_transfer += {want_ext} (> 0)": want_ext > 0 and d_delta["external_kv_transfer"] == want_ext,
        "D computed only the rest": d_delta["local_compute"] == n - want_ext,
        "token ids equal reference": got[1] == ref[1] and len(got[1]) == 16,
        "logprobs equal reference": got[2] == ref[2] and len(got[2]) == 16,
    }
    print(f"\n== {name}: prompt {n} tokens, {time.time() - t:.1f} s")
    print(f"   P response kv_transfer_params={p_json.get('kv_transfer_params')!r} text={parse(p_raw, chat, False)[0]!r}")
    print(f"   files: {files}")
    print(f"   D by_source before={d0} after={d1}")
    print(f"   reference by_source delta={ref_delta}")
    print(f"   D text={got[0]!r}\n   ref  ={ref[0]!r}\n   D ids={got[1]}")
    for k, v in checks.items():
        print(f"   {'ok  ' if v else 'FAIL'} {k}")
        ok &= v
sys.exit(0 if ok else 1)
EOF
echo "PASS in $(( $(date +%s) - t0 )) s"
