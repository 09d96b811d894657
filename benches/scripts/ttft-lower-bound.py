#!/usr/bin/env python3
"""The best time to first token any router could give a Mooncake trace replay on vllm-sim.

Each request is placed, with no wait, on a worker whose cache holds every prefix seen before it
(an infinite cache and a perfect router), and only its own prefill is counted: chunked into
steps of `max_num_batched_tokens`, each step timed by vllm-sim's step model (sim/src/timing.rs)
with no decode batch beside it. The percentiles of that time bound from below what
`kvgate-bench compare --trace` can measure for any target; the cached share bounds its hit rate.
The prefill load, against the fleet's time, says how busy the fleet is even at that best.

    benches/scripts/ttft-lower-bound.py ../shared/data/traces/mooncake_synthetic_trace.jsonl \
        --speedup 6 --workers 8

The defaults are compare's (prompts cut to 16,384 tokens) and vllm-sim's (8B model on an H100).
"""
import argparse
import json

TRACE_BLOCK = 512  # tokens per Mooncake hash id (benches/src/trace.rs)


def prefill_ms(cached, new, a):
    """vllm-sim's time for a chunked prefill of `new` tokens after `cached` ones, no decodes."""
    t, ctx = 0.0, cached
    while new > 0:
        chunk = min(a.max_num_batched_tokens, new)
        t += a.step_overhead_ms + a.prefill_ms_per_token * chunk + a.prefill_attn_ms_per_pair * chunk * (ctx + chunk / 2)
        ctx += chunk
        new -= chunk
    return t


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("trace")
    p.add_argument("--speedup", type=float, default=1.0)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--max-isl", type=int, default=16384)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--step-overhead-ms", type=float, default=6.0)
    p.add_argument("--prefill-ms-per-token", type=float, default=0.035)
    p.add_argument("--prefill-attn-ms-per-pair", type=float, default=1.3e-6)
    a = p.parse_args()

    with open(a.trace) as f:
        reqs = [json.loads(line) for line in f if line.strip()]
    seen = set()
    best, uncached_work, work, prompt_tokens, cached_tokens = [], 0.0, 0.0, 0, 0
    for r in reqs:
        length = min(r["input_length"], a.max_isl)
        ids = tuple(r["hash_ids"][: -(-length // TRACE_BLOCK)])
        shared = 0
        while shared < len(ids) and ids[: shared + 1] in seen:
            shared += 1
        # vLLM computes at least the prompt's last token, and caches whole blocks only.
        cached = min(shared * TRACE_BLOCK, (length - 1) // a.block_size * a.block_size)
        t = prefill_ms(cached, length - cached, a)
        best.append(t)
        work += t
        uncached_work += prefill_ms(0, length, a)
        prompt_tokens += length
        cached_tokens += cached
        seen.update(ids[: i + 1] for i in range(len(ids)))
    best.sort()
    pct = lambda q: best[int((len(best) - 1) * q)]
    span_ms = (reqs[-1]["timestamp"] - reqs[0]["timestamp"]) / a.speedup
    print(f"requests {len(best)}, replayed over {span_ms / 1000:.0f} s on {a.workers} workers")
    print(f"best TTFT: p50 {pct(0.5):.0f} ms, p90 {pct(0.9):.0f} ms, p99 {pct(0.99):.0f} ms")
    print(f"best hit rate (cached prompt tokens): {cached_tokens / prompt_tokens:.3f}")
    print(f"prefill load on the fleet: {work / (a.workers * span_ms):.2f} at that best, {uncached_work / (a.workers * span_ms):.2f} with no cache")
    at_bound = sum(1 for t in best if t >= pct(0.9) - 1e-9) / len(best)
    print(f"requests needing at least the p90 bound: {at_bound:.1%}")


if __name__ == "__main__":
    main()
