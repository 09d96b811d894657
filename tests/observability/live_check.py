#!/usr/bin/env python3
"""Live check of the dashboard and the rules against a real Prometheus scraping a real kvgate.

Starts vllm-sim workers, a nats-server and two kvgate replicas of one deployment on it (every
port of the system's choosing, read back from --ports-file, or for Prometheus and NATS from
/proc; the local connector's ports from a free run found at start), drives traffic that
exercises what the dashboard shows, lets Prometheus scrape both admin /metrics every second with
deploy/prometheus/kvgate-rules.yml loaded, then evaluates every target of every panel of
deploy/grafana/kvgate.json through Prometheus's HTTP API. A target fails when its query errors
or returns nothing but NaN or no series. Also checked: the scrape target is up, every rule
evaluates without error, and KvgateWorkerUnhealthy goes pending for the worker killed.

What makes the less common panels' data: the replicas' heartbeats (peer lag) and an admin
request for an id no replica holds (asked of the peer); a model with a prefill and a decode
worker (disaggregation); a model whose planner acts through the local connector, whose worker
is killed (an exit), whose replacement's start script refuses once (a failed change) before
one starts (a change's time), and whose minimum then drops by a reload (a scale-down that
moves a stream); on the second replica, the rescheduler moving a stream to a worker whose
context is too short for it (a failed move).

Run by tests/observability/prometheus.sh (which names the binaries). Every process it starts
runs in a process group of its own and is stopped by that group's id, on success, failure
or interruption. Prints one line per check and `N passed, M failed`; exit 1 on any failure.

Why not `kvgate demo`: its embedded configuration has no router queue, no tenants, no latency
objectives and no planner, so a third of the panels could only be checked for a valid query.
"""

import hashlib
import http.client
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DASHBOARD = os.path.join(ROOT, "deploy/grafana/kvgate.json")
RULES = os.path.join(ROOT, "deploy/prometheus/kvgate-rules.yml")

# Targets whose query is checked for validity only (it must parse and evaluate), each printed
# as such, with the reason. None: the setup builds everything the dashboard shows (replicas on
# NATS, a planner that acts through the local connector, prefill/decode workers, a rescheduler
# whose moves fail). A panel put here must say why its data cannot be produced in this check.
VALID_ONLY = {}

MODEL = "live"
TIGHT = "tight"
PD = "pd"  # a prefill and a decode worker (docs/disaggregation.md)
RETRIED = "retried"  # round robin over a worker that answers every request 500 and one that serves
SCALED = "scaled"  # a planner acting through the local connector (docs/planner.md)
MOVED = "moved"  # on the second replica: a rescheduler whose moves fail (docs/migration.md)
KEYS = {"team-a": "key-a-0123456789", "team-b": "key-b-0123456789"}

results = []  # (ok, line)


def check(ok, what):
    results.append(ok)
    print(("PASS " if ok else "FAIL ") + what, flush=True)


def log(msg):
    print("  .. " + msg, flush=True)


class Procs:
    """Processes started here, each the leader of its own process group."""

    def __init__(self):
        self.procs = []

    def start(self, args, out):
        p = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        self.procs.append(p)
        return p

    def stop(self, p, sig=signal.SIGTERM):
        try:
            os.killpg(p.pid, sig)
        except ProcessLookupError:
            pass

    def stop_all(self):
        for p in self.procs:
            self.stop(p)
        deadline = time.time() + 5
        for p in self.procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                self.stop(p, signal.SIGKILL)
                p.wait()


def wait_file(path, proc, what, timeout=30):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if os.path.exists(path):
            with open(path) as f:
                try:
                    return json.load(f)
                except ValueError:
                    pass
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited ({proc.returncode}) before writing {path}")
        time.sleep(0.05)
    raise RuntimeError(f"{what} wrote no {path} within {timeout} s")


def listening_port(pid, timeout=30):
    """The TCP port a process listens on, from /proc (Prometheus cannot report the port it
    got for :0)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        inodes = set()
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                try:
                    link = os.readlink(f"/proc/{pid}/fd/{fd}")
                except OSError:
                    continue
                if link.startswith("socket:["):
                    inodes.add(link[8:-1])
        except OSError:
            raise RuntimeError(f"process {pid} is gone")
        for table in ("/proc/net/tcp", "/proc/net/tcp6"):
            try:
                lines = open(table).read().splitlines()[1:]
            except OSError:
                continue
            for line in lines:
                f = line.split()
                if f[3] == "0A" and f[9] in inodes:
                    return int(f[1].split(":")[1], 16)
        time.sleep(0.1)
    raise RuntimeError(f"process {pid} listens on no TCP port after {timeout} s")


def http_json(method, url, body=None, headers=None, timeout=30):
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method, headers={"content-type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def wait_ok(url, timeout=30):
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            status, _ = http_json("GET", url, timeout=2)
            if status == 200:
                return
        except OSError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{url} did not answer 200 within {timeout} s")


class Gateway:
    def __init__(self, listen, admin):
        self.host, self.port = listen.rsplit(":", 1)
        self.admin = "http://127.0.0.1:" + admin.rsplit(":", 1)[1]
        self.port = int(self.port)

    def conn(self, timeout=60):
        return http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)

    def request(self, path, body, key=None, rid=None, read_chunks=None):
        """Sends one inference request; reads the whole answer, or `read_chunks` reads of a
        stream and then disconnects. Returns the status."""
        headers = {"content-type": "application/json"}
        if key:
            headers["authorization"] = "Bearer " + key
        if rid:
            headers["x-request-id"] = rid
        c = self.conn()
        try:
            c.request("POST", path, json.dumps(body), headers)
            r = c.getresponse()
            if read_chunks is None:
                r.read()
            else:
                for _ in range(read_chunks):
                    if not r.fp.readline():
                        break
                c.sock.shutdown(socket.SHUT_RDWR)
            return r.status
        except (OSError, http.client.HTTPException):
            return 0
        finally:
            c.close()


def chat(model, text, max_tokens, stream=True, **extra):
    b = {"model": model, "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": text}], "max_tokens": max_tokens, "stream": stream}
    b.update(extra)
    return b


WORDS = "the gateway routes each request to the worker that holds most of its prompt in cache and sheds load when every worker is full while the queue waits".split()
UNIQUE = iter(range(1_000_000))
SYSTEM = ("You are the assistant of an operations team. Answer briefly and name the metric you read. " * 8).strip()


def parallel(fns):
    out = [None] * len(fns)

    def run(i, f):
        out[i] = f()

    ts = [threading.Thread(target=run, args=(i, f)) for i, f in enumerate(fns)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return out


def drive(gw, victim):
    """Traffic that exercises every panel this setup can reach; `victim` is the worker killed
    at the end."""
    # 1. Streams and unary requests, chat and completions, shared prefixes, three tenants.
    keys = [KEYS["team-a"], None, KEYS["team-a"]]
    statuses = []
    for rnd in range(6):
        fns = []
        for i in range(4):
            key = keys[(rnd + i) % 3]
            if i == 3:
                fns.append(lambda key=key, rnd=rnd: gw.request("/v1/completions", {"model": MODEL, "prompt": SYSTEM + f" case {rnd}", "max_tokens": 12}, key))
            else:
                fns.append(lambda key=key, rnd=rnd, i=i: gw.request("/v1/chat/completions", chat(MODEL, f"question {rnd} from client {i}", 24, stream=i != 2), key))
        statuses += parallel(fns)
    log(f"traffic: {len(statuses)} requests, statuses {sorted(set(statuses))}")

    # 1b. The disaggregated model: streams and unary requests in two legs (prefill, decode).
    fns = [lambda i=i: gw.request("/v1/chat/completions", chat(PD, f"disaggregated {i}", 16, stream=i % 3 != 2)) for i in range(6)]
    log(f"disaggregated: statuses {parallel(fns)}")

    # 1b'. Retries, deterministically: round robin sends every other request first to the worker
    # that answers 500 (`retries.on_5xx`), and the other serves it.
    fns = [lambda i=i: gw.request("/v1/completions", {"model": RETRIED, "prompt": f"retried {i}", "max_tokens": 4}) for i in range(4)]
    log(f"retried: statuses {parallel(fns)}")

    # 1c. A request id no replica holds: asked of the peer (kvgate_cluster_forwarded_total).
    st, _ = http_json("GET", gw.admin + f"/requests/obs-nowhere-{next(UNIQUE)}")
    log(f"request held by no replica: {st}")

    # 2. A client that leaves mid-stream.
    s = gw.request("/v1/chat/completions", chat(MODEL, "a long answer please", 400), read_chunks=4)
    log(f"cancel: stream read 4 lines then disconnected (status {s})")

    # 3. A stream moved by POST /migrate, and one pinned (logprobs).
    moved = {}

    def long_stream():
        moved["status"] = gw.request("/v1/chat/completions", chat(MODEL, "stream to be moved", 200), rid="obs-move-1")

    t = threading.Thread(target=long_stream)
    t.start()
    for _ in range(50):
        time.sleep(0.1)
        st, body = http_json("GET", gw.admin + "/requests")
        if b"obs-move-1" in body and b"running" in body:
            break
    st, body = http_json("POST", gw.admin + "/migrate", {"request_id": "obs-move-1"}, timeout=60)
    log(f"migrate: {st} {body[:160].decode(errors='replace')}")
    t.join()
    gw.request("/v1/chat/completions", chat(MODEL, "with logprobs", 8, logprobs=True))

    # 4. A tenant over its requests per minute (429).
    st = [gw.request("/v1/chat/completions", chat(MODEL, f"b {i}", 4, stream=False), KEYS["team-b"]) for i in range(7)]
    log(f"team-b: statuses {st}")

    # 5. Refused before routing: a malformed head, a control path on the public listener; a
    # reload on the admin listener.
    with socket.create_connection(("127.0.0.1", gw.port), timeout=5) as s:
        s.sendall(b"GARBAGE\r\n\r\n")
        try:
            s.recv(1024)
        except OSError:
            pass
    c = gw.conn()
    c.request("POST", "/pause", "")
    log(f"control path on the public listener: {c.getresponse().status}")
    c.close()
    st, _ = http_json("POST", gw.admin + "/reload", {})
    log(f"reload: {st}")

    # 6. The router queue on the tight model (one worker with 64 KV blocks): long prompts of
    # their own (about 25 blocks each) book its cache whole after three; of the next ones two
    # wait in the queue (queue_max_len 2) until a stream ends, the rest get 429.
    depth = {"max": 0}

    def watch():
        for _ in range(20):
            st, body = http_json("GET", gw.admin + "/metrics")
            m = re.search(rb'kvgate_queued_requests\{model="tight"\} (\d+)', body)
            if m:
                depth["max"] = max(depth["max"], int(m.group(1)))
            time.sleep(0.1)

    def long_prompt(i):
        n = next(UNIQUE)
        return f"request {n}: " + " ".join(WORDS[(n * 7 + j) % len(WORDS)] for j in range(380))

    fns = [lambda i=i: (time.sleep(0.1 * i), gw.request("/v1/completions", {"model": TIGHT, "prompt": long_prompt(i), "max_tokens": 60, "stream": True}, KEYS["team-a"] if i % 2 else None))[1] for i in range(7)]
    fns.append(lambda: (time.sleep(0.3), watch())[1])
    st = parallel(fns)[:-1]
    log(f"queue: statuses {st}, deepest {depth['max']}")

    # 7. Shedding: every worker of the tight model busy from its first booked block.
    st, _ = http_json("POST", gw.admin + "/busy_threshold", {"model": TIGHT, "active_decode_blocks_threshold": 0.01})
    log(f"busy_threshold: {st}")
    fns = [lambda: gw.request("/v1/chat/completions", chat(TIGHT, "hold the worker", 100))]
    fns += [lambda i=i: (time.sleep(0.5 + 0.1 * i), gw.request("/v1/chat/completions", chat(TIGHT, f"shed {i}", 8)))[1] for i in range(4)]
    st = parallel(fns)
    http_json("POST", gw.admin + "/busy_threshold", {"model": TIGHT, "active_decode_blocks_threshold": 1.0})
    log(f"shedding: statuses {st}")

    # 8. A worker killed under streams: failover moves, upstream errors, the worker unhealthy,
    # its KV event stream gone (resync).
    fns = [lambda i=i: gw.request("/v1/chat/completions", chat(MODEL, f"failover {i}", 150)) for i in range(6)]
    fns.append(lambda: (time.sleep(0.8), os.killpg(victim.pid, signal.SIGKILL))[1])
    fns += [lambda i=i: (time.sleep(0.9), gw.request("/v1/completions", {"model": MODEL, "prompt": f"after the kill {i}", "max_tokens": 4}))[1] for i in range(6)]
    st = parallel(fns)
    log(f"failover: statuses {st}")


def prom_query(base, expr):
    url = base + "/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            v = json.load(r)
    except urllib.error.HTTPError as e:
        v = json.loads(e.read() or b"{}")
    if v.get("status") != "success":
        return None, v.get("error", "unknown error")
    return v["data"]["result"], None


def scraped_after(prom, t, timeout=20):
    """Waits until Prometheus has scraped both replicas twice after `t`."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        r, _ = prom_query(prom, 'timestamp(up{job="kvgate"})')
        if r and min(float(x["value"][1]) for x in r) > t + 1.5:
            return
        time.sleep(0.25)
    raise RuntimeError(f"prometheus did not scrape kvgate within {timeout} s")


def grafana_to_promql(expr):
    return expr.replace("$__rate_interval", "5m").replace("$__interval", "5m").replace("$__range", "5m").replace('"$model"', '".*"').replace('"$worker"', '".*"')


def main():
    kvgate_bin, sim_bin, prom_bin, promtool = sys.argv[1:5]
    started = time.time()
    for args, what in (([promtool, "check", "rules", RULES], "promtool check rules"), ([promtool, "test", "rules", RULES.replace(".yml", ".test.yml")], "promtool test rules")):
        r = subprocess.run(args, capture_output=True, text=True)
        check(r.returncode == 0, what + ("" if r.returncode == 0 else ":\n" + r.stdout + r.stderr))
    tmp = tempfile.mkdtemp(prefix="kvgate-obs-")
    procs = Procs()
    interrupted = []

    def on_signal(signum, _frame):
        interrupted.append(signum)
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        run(kvgate_bin, sim_bin, prom_bin, tmp, procs)
    except KeyboardInterrupt:
        check(False, "interrupted")
    except Exception as e:  # a setup failure is a failed check, with its reason
        check(False, f"setup: {e}")
    finally:
        procs.stop_all()
        if os.environ.get("KVGATE_OBS_KEEP"):
            print(f"  .. kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    passed, failed = results.count(True), results.count(False)
    print(f"{passed} passed, {failed} failed ({time.time() - started:.0f} s)")
    return 1 if failed or not passed else 0


def free_run(n):
    """The first of `n` consecutive ports below the system's ephemeral range that nothing
    listens on (the local connector takes its ports from such a run: the kernel never hands
    them out for port 0). A random start, so two checks at once do not race for one run."""
    import random

    try:
        floor = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    except (OSError, ValueError, IndexError):
        floor = 32768
    for _ in range(200):
        start = random.randrange(20000, max(20001, floor - n - 1))
        ok = True
        for port in range(start, start + n):
            with socket.socket() as sk:
                try:
                    sk.bind(("127.0.0.1", port))
                except OSError:
                    ok = False
                    break
        if ok:
            return start
    raise RuntimeError(f"no run of {n} free ports below {floor}")


def metric_sum(gw, name, labels=""):
    """The sum of a metric's samples on a gateway's /metrics whose labels contain `labels`."""
    _, body = http_json("GET", gw.admin + "/metrics")
    total = 0.0
    for line in body.decode().splitlines():
        if line.startswith(name) and (line[len(name)] in " {") and labels in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def wait_for(what, cond, timeout=20, every=0.1):
    deadline = time.time() + timeout
    while time.time() < deadline:
        v = cond()
        if v:
            return v
        time.sleep(every)
    raise RuntimeError(f"{what}: not within {timeout} s")


def planner_workers(gw):
    """The workers of `scaled` that its planner started (GET /workers)."""
    _, body = http_json("GET", gw.admin + "/workers")
    models = json.loads(body).get("models", [])
    return [w for m in models if m.get("model") == SCALED for w in m.get("workers", []) if str(w.get("origin", "")).startswith("planner:")]


def hold_stream(gw, model, prompt, stop, max_tokens=3000):
    """A stream held open until `stop` is set, then dropped by the client."""
    c = gw.conn()
    try:
        c.request("POST", "/v1/completions", json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "stream": True}), {"content-type": "application/json"})
        r = c.getresponse()
        c.sock.settimeout(0.2)  # a stream that goes quiet does not keep `stop` waiting
        while not stop.is_set():
            try:
                if not r.fp.readline():
                    break
            except TimeoutError:
                continue
        c.sock.shutdown(socket.SHUT_RDWR)
        return r.status
    except (OSError, http.client.HTTPException):
        return 0
    finally:
        c.close()


def planner_flow(gw, prom, tmp, flag, write_config):
    """The planner of `scaled` acting through the local connector (min 2 workers: the configured
    one and one it starts): its worker is killed (an exit), its replacement fails to start (a
    failed change: the start script refuses while `flag` exists), the next one starts (a
    change's time, after Prometheus has seen the first), then the minimum drops to 1 (a reload)
    and the scale-down moves the streams running on the removed worker."""
    first = wait_for("the planner's first worker joined", lambda: planner_workers(gw), 30)[0]
    log(f"planner: started {first['url']}")
    scraped_after(prom, time.time())
    port = first["url"].rstrip("/").rsplit(":", 1)[1]
    pid = int(open(os.path.join(tmp, f"planner-{port}.pid")).read())
    open(flag, "w").close()
    os.killpg(pid, signal.SIGKILL)
    wait_for("the killed worker counted as an exit", lambda: metric_sum(gw, "kvgate_planner_worker_exits_total", f'model="{SCALED}"') >= 1)
    wait_for("a failed start counted", lambda: metric_sum(gw, "kvgate_planner_changes_failed_total", f'model="{SCALED}"') >= 1)
    os.unlink(flag)
    # The replacement takes the lowest free port again, often the killed worker's: it is told
    # apart by the count of changes that ended in routing.
    wait_for("the planner's replacement joined", lambda: metric_sum(gw, "kvgate_planner_change_seconds_count", f'change="up",model="{SCALED}"') + metric_sum(gw, "kvgate_planner_change_seconds_count", f'model="{SCALED}",change="up"') >= 2, 30)
    second = wait_for("the planner's replacement in routing", lambda: [w for w in planner_workers(gw) if w.get("healthy")], 10)[0]
    log(f"planner: killed {first['url']} (exit), a start refused (failed change), replaced by {second['url']}")
    # Streams until one runs on the planner's worker; then the scale-down moves it.
    stop = threading.Event()
    threads = []
    try:

        def on_second():
            _, body = http_json("GET", gw.admin + "/requests")
            return second["url"].rstrip("/").encode() in body and b"running" in body

        for i in range(8):
            t = threading.Thread(target=hold_stream, args=(gw, SCALED, f"scaled stream {i} {next(UNIQUE)}", stop, 400))
            t.start()
            threads.append(t)
            try:
                wait_for("a stream on the planner's worker", on_second, 1.0)
                break
            except RuntimeError:
                continue
        wait_for("a stream on the planner's worker", on_second, 5)
        write_config(1)
        st, _ = http_json("POST", gw.admin + "/reload", {})
        wait_for("the scale-down moved a stream", lambda: metric_sum(gw, "kvgate_planner_moved_requests_total", f'model="{SCALED}"') >= 1, 30)
        log(f"planner: reload to min 1 ({st}), scaled down with a stream moved")
    finally:
        stop.set()
        for t in threads:
            t.join()


def rescheduler_flow(gw2, prom, write_config2, refusing):
    """On the second replica, twice (a scrape apart, so the counter's rate is more than 0): a
    stream on `moved`'s only worker, then a reload adds a worker whose context is too short
    for the stream's continuation: the rescheduler's decode_load policy pairs the loaded worker
    with the idle one, and the move fails (the destination answers 400, which ends the move
    and cuts the stream). A reload takes the refusing worker out again."""
    for attempt in range(2):
        before = metric_sum(gw2, "kvgate_rescheduling_failed_total", f'model="{MOVED}"')
        stop = threading.Event()
        prompt = f"moved {next(UNIQUE)}: " + " ".join(WORDS[j % len(WORDS)] for j in range(300))
        t = threading.Thread(target=hold_stream, args=(gw2, MOVED, prompt, stop, 1500))
        t.start()
        try:
            wait_for("the stream runs on the second replica", lambda: b"running" in http_json("GET", gw2.admin + "/requests")[1], 10)
            write_config2(True)
            st, _ = http_json("POST", gw2.admin + "/reload", {})
            wait_for("a failed rescheduler move", lambda: metric_sum(gw2, "kvgate_rescheduling_failed_total", f'model="{MOVED}"') > before, 20)
        finally:
            stop.set()
            t.join()
            write_config2(False)
            st2, _ = http_json("POST", gw2.admin + "/reload", {})
        log(f"rescheduler: reload adding {refusing} ({st}), a move failed, reload without it ({st2})")
        scraped_after(prom, time.time())


def run(kvgate_bin, sim_bin, prom_bin, tmp, procs):
    # Workers: three for `live`, one with a small KV cache for `tight`, a prefill and a decode
    # worker for `pd`, the configured worker of `scaled`, and for the second replica's `moved`
    # a worker with a small KV cache and one with a context too short for its streams; for
    # `retried`, one that serves and one that answers every request 500 (retries).
    kv = '{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://*:0","replay_endpoint":"tcp://*:0","topic":""}'
    nixl = '{{"kv_connector":"NixlConnector","kv_role":"{}"}}'
    specs = [
        (MODEL, []),
        (MODEL, []),
        (MODEL, []),
        (TIGHT, ["--num-gpu-blocks-override", "64", "--max-model-len", "1000"]),
        (PD, ["--kv-transfer-config", nixl.format("kv_producer")]),
        (PD, ["--kv-transfer-config", nixl.format("kv_consumer")]),
        (SCALED, ["--num-gpu-blocks-override", "200", "--max-model-len", "2048"]),
        (MOVED, ["--num-gpu-blocks-override", "128", "--max-model-len", "2000"]),
        (MOVED, ["--max-model-len", "64"]),
        (RETRIED, []),
        (RETRIED, ["--fail-error-rate", "1.0"]),
    ]
    sims = []
    for i, (model, extra) in enumerate(specs):
        pf = os.path.join(tmp, f"sim{i}.json")
        args = [sim_bin, "--model", model, "--host", "127.0.0.1", "--port", "0", "--seed", str(i + 1), "--kv-events-config", kv, "--ports-file", pf] + extra
        p = procs.start(args, open(os.path.join(tmp, f"sim{i}.log"), "w"))
        sims.append((p, pf))
    workers = []
    for p, pf in sims:
        b = wait_file(pf, p, "vllm-sim")
        workers.append({"url": b["url"], "kv_events": b["kv_events"][0].replace("*", "127.0.0.1"), "replay": b["replay"][0].replace("*", "127.0.0.1")})
    for w in workers:
        wait_ok(w["url"] + "/health")
    log("workers: " + " ".join(w["url"] for w in workers))

    # NATS (JetStream) for the two replicas, on a port of the system's choosing.
    os.makedirs(os.path.join(tmp, "nats"))
    np_ = procs.start(["nats-server", "-a", "127.0.0.1", "-p", "-1", "-js", "-sd", os.path.join(tmp, "nats")], open(os.path.join(tmp, "nats.log"), "w"))
    nats = f"nats://127.0.0.1:{listening_port(np_.pid)}"
    log(f"nats: {nats}")

    def worker_yaml(ws, roles=None):
        return "".join(f"      - url: {w['url']}\n        kv_events: {w['kv_events']}\n        replay: {w['replay']}\n" + (f"        role: {roles[i]}\n" if roles else "") for i, w in enumerate(ws))

    # The local connector's workers: a start script that refuses while `flag` exists, and
    # records its pid (it execs vllm-sim, so the pid is the worker's and its process group's).
    flag = os.path.join(tmp, "refuse-start")
    script = os.path.join(tmp, "planner-worker.sh")
    pkv = '{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://*:\'"$2"\'","topic":""}'
    open(script, "w").write(
        f"""#!/bin/sh
# $1: the HTTP port, $2: the KV events port (the local connector's {{port}} and {{kv_port}}).
if [ -e '{flag}' ]; then echo "refusing to start: {flag} exists"; exit 1; fi
echo $$ > '{tmp}/planner-'"$1"'.pid'
exec '{sim_bin}' --model {SCALED} --host 127.0.0.1 --port "$1" --num-gpu-blocks-override 200 --max-model-len 2048 --kv-events-config '{pkv}'
"""
    )
    ports_from, kv_ports_from = free_run(6), None
    while kv_ports_from is None or abs(kv_ports_from - ports_from) < 6:
        kv_ports_from = free_run(6)

    digest = {t: hashlib.sha256(k.encode()).hexdigest() for t, k in KEYS.items()}
    cfg = os.path.join(tmp, "kvgate.yaml")

    def replica_head(replica):
        """What both replicas' configs begin with: listeners of the system's choosing, quick
        health and load polling, and the one deployment on the NATS above."""
        return f"""listen: 127.0.0.1:0
admin_listen: 127.0.0.1:0
health:
  interval_ms: 300
  unhealthy_threshold: 1
load:
  interval_ms: 200
cluster:
  nats_url: {nats}
  deployment: obs
  replica: {replica}
"""

    def write_config(min_workers):
        config = f"""{replica_head("gw-a")}tenants:
  list:
    - name: team-a
      keys_sha256: [{digest['team-a']}]
      priority: 1
    - name: team-b
      keys_sha256: [{digest['team-b']}]
      requests_per_minute: 3
    - name: default
models:
  - name: {MODEL}
    tokenizer: builtin
    routing:
      mode: kv
    slo:
      ttft_ms: 5000
      tpot_ms: 500
    planner:
      enabled: true
      mode: observe_only
      metric_pulling_interval_s: 1
      adjustment_interval_s: 2
    workers:
{worker_yaml(workers[:3])}  - name: {TIGHT}
    tokenizer: builtin
    routing:
      mode: kv
      queue_threshold: 0.9
      queue_max_len: 2
      queue_max_wait_ms: 1500
    shedding:
      max_num_batched_tokens: 8192
    workers:
{worker_yaml(workers[3:4])}  - name: {PD}
    tokenizer: builtin
    routing:
      mode: kv
    disaggregation:
      min_prefill_tokens: 0
    workers:
{worker_yaml(workers[4:6], ["prefill", "decode"])}  - name: {SCALED}
    tokenizer: builtin
    routing:
      mode: kv
    planner:
      enabled: true
      mode: act
      metric_pulling_interval_s: 0.25
      adjustment_interval_s: 1
      min_gpu_budget: {min_workers}
      max_gpu_budget: 2
      decode_kv_scale_up_threshold: 0.99
      decode_kv_scale_down_threshold: 0.9
      new_decode_worker_grace_period: 0
      drain_timeout_s: 20
      log: {tmp}/planner.jsonl
      connector:
        kind: local
        command: "sh {script} {{port}} {{kv_port}}"
        ports_from: {ports_from}
        kv_ports_from: {kv_ports_from}
        log_dir: {tmp}/planner-workers
        ready_timeout_s: 20
        stop_timeout_s: 5
    workers:
{worker_yaml(workers[6:7])}  - name: {RETRIED}
    tokenizer: builtin
    workers:
{worker_yaml(workers[9:11])}"""
        tmpf = cfg + ".new"
        open(tmpf, "w").write(config)
        os.replace(tmpf, cfg)

    write_config(2)
    pf = os.path.join(tmp, "kvgate.json")
    env_log = open(os.path.join(tmp, "kvgate.log"), "w")
    gwp = subprocess.Popen([kvgate_bin, "--config", cfg, "--ports-file", pf], stdout=env_log, stderr=subprocess.STDOUT, start_new_session=True, env={**os.environ, "KVGATE_LOG": "warn"})
    procs.procs.append(gwp)
    b = wait_file(pf, gwp, "kvgate")
    gw = Gateway(b["listen"], b["admin_listen"])
    wait_ok(gw.admin + "/metrics")
    log(f"kvgate: public {b['listen']}, admin {b['admin_listen']}")
    # It leads (holds the lease) before the second replica starts: its planner acts.
    wait_for("the first replica leads", lambda: re.search(rb'"leads":\s*true', http_json("GET", gw.admin + "/cluster")[1]), 20)

    # The second replica: the same deployment on the same NATS, its own model, the rescheduler.
    cfg2 = os.path.join(tmp, "kvgate2.yaml")

    def write_config2(with_refusing):
        config = f"""{replica_head("gw-b")}rescheduling:
  enable_rescheduling: true
  rescheduling_policies: decode_load
  rescheduling_interval_ms: 300
  rescheduling_decode_load_metric: kv_cache_usage_ratio
  rescheduling_decode_load_threshold: 0.05
  rescheduling_req_select_rule: NUM_REQ
  rescheduling_req_select_value: 1
  llumlet_grpc_timeout_seconds: 2
models:
  - name: {MOVED}
    tokenizer: builtin
    routing:
      mode: kv
    workers:
{worker_yaml(workers[7:9] if with_refusing else workers[7:8])}"""
        tmpf = cfg2 + ".new"
        open(tmpf, "w").write(config)
        os.replace(tmpf, cfg2)

    write_config2(False)
    pf2 = os.path.join(tmp, "kvgate2.json")
    gwp2 = subprocess.Popen([kvgate_bin, "--config", cfg2, "--ports-file", pf2], stdout=open(os.path.join(tmp, "kvgate2.log"), "w"), stderr=subprocess.STDOUT, start_new_session=True, env={**os.environ, "KVGATE_LOG": "warn"})
    procs.procs.append(gwp2)
    b2 = wait_file(pf2, gwp2, "kvgate (second replica)")
    gw2 = Gateway(b2["listen"], b2["admin_listen"])
    wait_ok(gw2.admin + "/metrics")
    wait_for("the replicas see each other", lambda: metric_sum(gw, "kvgate_cluster_peers") >= 1 and metric_sum(gw2, "kvgate_cluster_peers") >= 1, 20)
    log(f"kvgate (second replica): public {b2['listen']}, admin {b2['admin_listen']}")

    # Prometheus on a port of the system's choosing, scraping both admin listeners every second,
    # as one job (replicas of one deployment are, for KvgateClusterNoLeader).
    prom_cfg = os.path.join(tmp, "prometheus.yml")
    open(prom_cfg, "w").write(
        f"""global:
  scrape_interval: 1s
  evaluation_interval: 1s
rule_files:
  - {RULES}
scrape_configs:
  - job_name: kvgate
    static_configs:
      - targets: ['{gw.admin[len("http://"):]}', '{gw2.admin[len("http://"):]}']
"""
    )
    pp = procs.start(
        [prom_bin, f"--config.file={prom_cfg}", f"--storage.tsdb.path={tmp}/tsdb", "--web.listen-address=127.0.0.1:0", "--storage.tsdb.retention.time=1h"],
        open(os.path.join(tmp, "prometheus.log"), "w"),
    )
    prom = f"http://127.0.0.1:{listening_port(pp.pid)}"
    wait_ok(prom + "/-/ready", timeout=60)
    log(f"prometheus: {prom}")

    # The planner's and the rescheduler's sequences run beside the load.
    flows = {}

    def flow(name, fn, *args):
        try:
            fn(*args)
            flows[name] = None
        except Exception as e:  # reported as a failed check below
            flows[name] = str(e)

    side = [
        threading.Thread(target=flow, args=("planner", planner_flow, gw, prom, tmp, flag, write_config)),
        threading.Thread(target=flow, args=("rescheduler", rescheduler_flow, gw2, prom, write_config2, workers[8]["url"])),
    ]
    for t in side:
        t.start()

    # The load runs twice, a scrape apart, with a worker killed at the end of each round: rate()
    # and increase() only count what a series gained after Prometheus first saw it, so an event
    # that happens once, creating its series, shows in no rate (as in production a series that
    # has just appeared does not).
    scraped_after(prom, time.time())
    for rnd, (victim, _) in enumerate(sims[:2]):
        log(f"round {rnd + 1}")
        drive(gw, victim)
        scraped_after(prom, time.time())
    for t in side:
        t.join()
    for name, err in flows.items():
        check(err is None, f"{name} sequence" + (f": {err}" if err else " done"))
    scraped_after(prom, time.time())

    r, err = prom_query(prom, 'up{job="kvgate"}')
    check(len(r or []) == 2 and all(x["value"][1] == "1" for x in r), f"prometheus scrapes both replicas' admin /metrics (up == 1: {len(r or [])} targets)")
    r, err = prom_query(prom, 'count(count_over_time(up{job="kvgate"}[5m]))')
    r2, _ = prom_query(prom, 'sum(count_over_time(up{job="kvgate"}[5m]))')
    scrapes = int(float(r2[0]["value"][1])) if r2 else 0
    check(scrapes >= 10, f"prometheus scraped kvgate {scrapes} times")

    # Every rule evaluates without error.
    with urllib.request.urlopen(prom + "/api/v1/rules", timeout=10) as f:
        groups = json.load(f)["data"]["groups"]
    rules = [r for g in groups for r in g["rules"]]
    bad = [f"{r['name']}: {r.get('lastError')}" for r in rules if r.get("health") != "ok"]
    check(len(rules) > 0 and not bad, f"{len(rules)} rules loaded and evaluated without error" + (f": {bad}" if bad else ""))
    with urllib.request.urlopen(prom + "/api/v1/alerts", timeout=10) as f:
        alerts = json.load(f)["data"]["alerts"]
    killed = workers[0]["url"]
    seen = [a for a in alerts if a["labels"].get("alertname") == "KvgateWorkerUnhealthy" and a["labels"].get("worker", "").rstrip("/") == killed.rstrip("/")]
    check(bool(seen), f"KvgateWorkerUnhealthy {seen[0]['state'] if seen else 'absent'} for the killed worker {killed}")
    others = sorted({a["labels"]["alertname"] for a in alerts} - {"KvgateWorkerUnhealthy"})
    log(f"other alerts pending or firing: {others or 'none'}")

    # Every panel's every query.
    dash = json.load(open(DASHBOARD))
    panels = [p for p in dash["panels"] if p.get("type") != "row"]
    for p in dash["panels"]:
        panels += p.get("panels", [])
    valid_only = 0
    for p in panels:
        for t in p.get("targets", []):
            expr = grafana_to_promql(t["expr"])
            what = f"panel \"{p['title']}\" {t['refId']}"
            res, err = prom_query(prom, expr)
            if err:
                check(False, f"{what}: query error: {err}: {expr}")
                continue
            if p["title"] in VALID_ONLY:
                valid_only += 1
                check(True, f"{what}: valid query (data not checked: {VALID_ONLY[p['title']]})")
                continue
            values = [s["value"][1] for s in res]
            real = [v for v in values if v not in ("NaN", "+Inf", "-Inf")]
            if not values:
                check(False, f"{what}: no data: {expr}")
            elif not real:
                check(False, f"{what}: only NaN ({len(values)} series): {expr}")
            else:
                check(True, f"{what}: {len(values)} series")
    log(f"{valid_only} targets checked for validity only")
    unknown = set(VALID_ONLY) - {p["title"] for p in panels}
    check(not unknown, "every validity-only panel named here is in the dashboard" + (f": missing {sorted(unknown)}" if unknown else ""))


if __name__ == "__main__":
    sys.exit(main())
