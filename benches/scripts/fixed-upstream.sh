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

# Prints a loopback port below the kernel's ephemeral range: one the kernel never hands out by
# itself (to an outgoing connection or a bind to port 0), so only a server told to bind it can
# hold it. The server binds it once; a start that finds it taken is tried again on another
# (start_nginx). Servers that can bind port 0 and say which port they got do that instead.
reserved_port() {
    local floor
    floor=$(cut -f1 /proc/sys/net/ipv4/ip_local_port_range 2>/dev/null || echo 32768)
    echo $(( 10000 + (RANDOM * 32768 + RANDOM) % (floor - 10000) ))
}

# Starts nginx from $OUT/$1.conf.in, its listen port (@PORT@ there) a reserved one, and prints
# the port. nginx binds before it detaches and fails when the port is taken: then another is tried.
start_nginx() {
    local name=$1 port
    for _ in $(seq 20); do
        port=$(reserved_port)
        sed "s/@PORT@/$port/g" "$OUT/$name.conf.in" >"$OUT/$name.conf"
        if nginx -c "$OUT/$name.conf" 2>>"$OUT/$name-start.log"; then
            echo "$port"
            return 0
        fi
    done
    echo "nginx $name did not start on any of 20 ports ($OUT/$name-start.log)" >&2
    return 1
}

# Waits for the --ports-file $1 that process $2 writes once bound (our binaries write it whole,
# by a rename) and prints the port of each listener named after them ("listen",
# "admin_listen"). Fails when the process exits first (its log: $3).
ports_from_file() {
    local file=$1 pid=$2 log=$3
    shift 3
    for _ in $(seq 600); do
        [ -s "$file" ] && break
        kill -0 "$pid" 2>/dev/null || { echo "$pid exited before binding: $(tail -5 "$log" 2>/dev/null)" >&2; return 1; }
        sleep 0.1
    done
    python3 -c 'import json, sys
v = json.load(open(sys.argv[1]))
print(*[v[k].rsplit(":", 1)[1] for k in sys.argv[2:]])' "$file" "$@"
}

# Starts kvgate binary $1 on $OUT/kvgate.yaml in the background (extra arguments after it, e.g.
# a wrapper's: KVGATE_WRAP="valgrind ..."); sets KV (its pid), GW and ADMIN (its ports). It binds
# port 0 and writes the ports it got to --ports-file; a binary from before that option gets
# reserved ports, and another pair when they were taken.
start_kvgate() {
    local bin=$1 try
    if "$bin" --help 2>/dev/null | grep -q -- --ports-file; then
        write_kvgate_conf 0 0 "$UP" "${KVGATE_EXTRA:-}"
        rm -f "$OUT/kvgate.ports"
        ${KVGATE_WRAP:-} "$bin" --config "$OUT/kvgate.yaml" --ports-file "$OUT/kvgate.ports" >"$OUT/kvgate.log" 2>&1 &
        KV=$!
        read -r GW ADMIN < <(ports_from_file "$OUT/kvgate.ports" "$KV" "$OUT/kvgate.log" listen admin_listen)
        [ -n "${ADMIN:-}" ]
        return
    fi
    for try in $(seq 10); do
        GW=$(reserved_port) ADMIN=$(reserved_port)
        write_kvgate_conf "$GW" "$ADMIN" "$UP" "${KVGATE_EXTRA:-}"
        ${KVGATE_WRAP:-} "$bin" --config "$OUT/kvgate.yaml" >"$OUT/kvgate.log" 2>&1 &
        KV=$!
        wait_ready "http://127.0.0.1:$GW/v1/completions" 2>/dev/null && return 0
        kill "$KV" 2>/dev/null || true
        wait "$KV" 2>/dev/null || true
    done
    echo "kvgate did not start on any of 10 port pairs ($OUT/kvgate.log)" >&2
    return 1
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

# Writes $OUT/$1.conf.in: one nginx worker (pid $OUT/$1.pid, no access log) serving the http
# block's contents $2.
write_nginx_conf() {
    cat >"$OUT/$1.conf.in" <<CONF
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

# Writes $OUT/upstream.conf.in: nginx answering every request with the fixed answer (call
# fixed_answer first), on the port start_nginx gives it.
write_upstream_conf() {
    write_nginx_conf upstream "  server {
    listen 127.0.0.1:@PORT@;
    location / {
      default_type $TYPE;
      return 200 '$ANSWER';
    }
  }"
}

# Writes $OUT/nginx.conf.in: nginx as a reverse proxy in front of the upstream on port $1 (one
# worker, a keep-alive upstream pool, buffering off: the comparison kvgate is held to), on the
# port start_nginx gives it.
write_nginx_proxy_conf() {
    write_nginx_conf nginx "  upstream up { server 127.0.0.1:$1; keepalive 128; }
  server {
    listen 127.0.0.1:@PORT@;
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

# Starts what a proxy comparison needs, each server on a port it bound itself: the
# fixed-answer upstream (UP), kvgate binary $1 in front of it (KV, GW, ADMIN; extra top-level
# config lines in KVGATE_EXTRA), and, unless $2 is "no-nginx", nginx as a proxy (NG); writes
# the wrk request.
start_comparison() {
    fixed_answer
    write_upstream_conf
    UP=$(start_nginx upstream)
    start_kvgate "$1"
    if [ "${2:-}" != no-nginx ]; then
        write_nginx_proxy_conf "$UP"
        NG=$(start_nginx nginx)
    fi
    write_post_lua
}
