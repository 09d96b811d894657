# Shared by the proxy cost scripts (sourced, not run): a fixed-answer nginx upstream, a
# round_robin kvgate in front of it, and the wrk request, so every script measures the same
# setup. Each function writes into $OUT.

# Exits with an install hint ($1) unless every command named after it is on the PATH.
needs() {
    local hint=$1 tool
    shift
    for tool in "$@"; do
        command -v "$tool" >/dev/null || { echo "needs $tool ($hint)" >&2; exit 2; }
    done
}

# Prints $1 free loopback ports.
free_ports() {
    python3 -c 'import socket, sys
s = [socket.socket() for _ in range(int(sys.argv[1]))]
[x.bind(("127.0.0.1", 0)) for x in s]
print(*[x.getsockname()[1] for x in s])' "$1"
}

# Sets TYPE, ANSWER and STREAM for KIND (unary: one JSON completion; stream: 16 token events
# and [DONE] in one body, as a worker that flushed several events at once sends them).
fixed_answer() {
    if [ "${KIND:-unary}" = stream ]; then
        TYPE=text/event-stream
        ANSWER=$(for i in $(seq 16); do printf 'data: {"id":"cmpl-1","object":"text_completion","created":1,"model":"m","choices":[{"index":0,"text":" t%d","logprobs":null,"finish_reason":null}]}\n\n' "$i"; done; printf 'data: [DONE]\n\n')
        STREAM=true
    else
        TYPE=application/json
        ANSWER='{"id":"cmpl-1","object":"text_completion","created":1,"model":"m","choices":[{"index":0,"text":" ok","finish_reason":"length"}],"usage":{"prompt_tokens":40,"completion_tokens":1,"total_tokens":41}}'
        STREAM=false
    fi
}

# Writes $OUT/$1.conf: one nginx worker (pid $OUT/$1.pid, no access log) serving the http
# block's contents $2.
write_nginx_conf() {
    cat >"$OUT/$1.conf" <<CONF
worker_processes 1;
pid $OUT/$1.pid;
error_log $OUT/$1-error.log;
events { worker_connections 1024; }
http {
  access_log off;
$2
}
CONF
}

# Writes $OUT/upstream.conf: nginx answering every request on port $1 with the fixed answer
# (call fixed_answer first).
write_upstream_conf() {
    write_nginx_conf upstream "  server {
    listen 127.0.0.1:$1;
    location / {
      default_type $TYPE;
      return 200 '$ANSWER';
    }
  }"
}

# Writes $OUT/nginx.conf: nginx as a reverse proxy on port $1 in front of the upstream on port
# $2 (one worker, a keep-alive upstream pool, buffering off: the comparison kvgate is held to).
write_nginx_proxy_conf() {
    write_nginx_conf nginx "  upstream up { server 127.0.0.1:$2; keepalive 128; }
  server {
    listen 127.0.0.1:$1;
    location / { proxy_pass http://up; proxy_http_version 1.1; proxy_set_header Connection \"\"; proxy_buffering off; }
  }"
}

# Writes $OUT/kvgate.yaml: kvgate on port $1 (admin $2), round_robin over the upstream on
# port $3, with $4 extra top-level lines (e.g. "threads: 1").
write_kvgate_conf() {
    cat >"$OUT/kvgate.yaml" <<CONF
listen: 127.0.0.1:$1
admin_listen: 127.0.0.1:$2
${4:-}
models:
  - name: m
    routing:
      mode: round_robin
    workers:
      - url: http://127.0.0.1:$3
CONF
}

# Writes $OUT/post.lua: wrk's POST /v1/completions (streamed when STREAM is true).
write_post_lua() {
    cat >"$OUT/post.lua" <<LUA
wrk.method = "POST"
wrk.body = '{"model":"m","prompt":"You are a helpful assistant. Summarize the following report in three sentences, keeping every figure: the gateway forwarded the request to the worker that already held most of its prompt in its KV cache.","max_tokens":16,"stream":$STREAM}'
wrk.headers["Content-Type"] = "application/json"
LUA
}

# Waits (up to a minute) until $1 answers a completion.
wait_ready() {
    for _ in $(seq 300); do
        curl -s -o /dev/null -XPOST -H 'content-type: application/json' -d '{"model":"m","prompt":"x","max_tokens":1}' "$1" && return 0
        sleep 0.2
    done
    echo "no answer from $1" >&2
    return 1
}

# Writes every file a proxy comparison needs into $OUT: the fixed-answer upstream on port $1,
# kvgate on port $2 (admin $3) with extra top-level lines $5, nginx as a proxy on port $4, and
# the wrk request.
write_comparison() {
    fixed_answer
    write_upstream_conf "$1"
    write_kvgate_conf "$2" "$3" "$1" "${5:-}"
    write_nginx_proxy_conf "$4" "$1"
    write_post_lua
}
