"""The OpenAI and Anthropic SDKs against a tenant out of requests: each, with its default
retries, gets one 429, waits the retry-after-ms / retry-after it is given, and succeeds.
Usage: sdk_retries.py GATEWAY_URL MODEL (the gateway's tenants are set up by the Rust test)."""
import sys
import time

import anthropic
import httpx
import openai

base, model = sys.argv[1], sys.argv[2]
LIMIT = 6  # requests per minute of each tenant


def hooked(httpx=httpx):
    seen = []
    client = httpx.Client(event_hooks={"response": [lambda r: seen.append((time.monotonic(), r.status_code, r.headers.get("retry-after-ms")))]})
    return client, seen


def check(name, call, seen):
    for _ in range(LIMIT):
        call()
    seen.clear()
    start = time.monotonic()
    call()
    took = time.monotonic() - start
    statuses = [s for _, s, _ in seen]
    assert statuses == [429, 200], f"{name}: {statuses}"
    told = float(seen[0][2]) / 1000.0
    waited = seen[1][0] - seen[0][0]
    # It waited what it was told (less a little of the retried request's own time, which the
    # gap includes), and not a backoff of its own on top.
    assert told * 0.98 <= waited <= told + 5.0, f"{name}: told {told:.2f} s, waited {waited:.2f} s"
    print(f"{name}: 429, told to wait {told:.2f} s, retried after {waited:.2f} s, succeeded in {took:.2f} s")


oc_http, oc_seen = hooked()
oc = openai.OpenAI(base_url=base + "/v1", api_key="sk-openai-sdk", http_client=oc_http)
check("openai", lambda: oc.completions.create(model=model, prompt="hi", max_tokens=1), oc_seen)

try:
    # Newer Anthropic SDKs ship their own fork of httpx and refuse a client of the other.
    import httpx2 as anthropic_httpx
except ImportError:
    anthropic_httpx = httpx
ac_http, ac_seen = hooked(anthropic_httpx)
ac = anthropic.Anthropic(base_url=base, api_key="sk-anthropic-sdk", http_client=ac_http)
check("anthropic", lambda: ac.messages.create(model=model, max_tokens=1, messages=[{"role": "user", "content": "hi"}]), ac_seen)
print("all checks passed")
