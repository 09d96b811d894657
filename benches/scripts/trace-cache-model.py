#!/usr/bin/env python3
"""How much of a Mooncake trace's prefix reuse placement alone can keep in the workers' caches.

A model, not the simulator: each worker is an LRU cache of the trace's 512-token blocks (a
block of a request that is still running cannot be evicted; at its end its blocks join the LRU
list), and a prefill queue that computes a request's uncached tokens at vllm-sim's single-prompt
speed, one request after another. Requests end their prefill plus their output at a fixed time
per token later. Placement rules are replayed over the trace's arrivals, and the model prints
the share of prompt tokens found cached (the hit rate the bench reports) and, as a rough guide
only, the queue's first-token p90.

The rules:
- `greedy`: the least predicted first token (queue plus uncached prefill), ties drawn at random
  (kvgate's cost without its other terms);
- `cache_aware`: vllm-router's rule in outline (the best prefix match above half the prompt,
  else the worker that has stored the fewest tokens, unless the requests in flight are out of
  balance);
- `least_written`: `greedy`, ties to the worker that has stored the fewest tokens;
- `evict_aware`: `greedy` plus the prefill time of the blocks the request would evict that were
  used within the last `--young` seconds;
- `future_priced`: `greedy` plus the prefill time of the evicted blocks some later request uses
  (a placement that knows the future; the caches still evict least recently used first);
- `belady`: `greedy` placement on caches that evict the block next used furthest ahead (never
  used again first), the best any eviction can keep for those placements: no router, which
  cannot choose what vLLM evicts, keeps more of the trace's reuse by eviction;
- `keep_alive`: `greedy`, and every prompt of `--keep-tokens` or more kept recently used on its
  worker for `--keep-s` seconds after it arrived, by a touch every `--touch-every` seconds (what
  a one-token request reusing the prefix would do to vLLM's least-recently-used order); the
  touches are counted.

    benches/scripts/trace-cache-model.py benches/traces/mooncake_synthetic_trace.jsonl \\
        --requests 800 --speedup 5 --seeds 3

Its defaults are `compare`'s for the trace: 8 workers, 16,384 blocks of 16 tokens each, prompts
cut to 16,384 tokens (`--max-isl`); outputs are not cut (`--max-osl` 1,024 is longer than any of
the trace's first 800).
"""
import argparse
import bisect
import heapq
import json
import random
import sys
from collections import OrderedDict

BLOCK = 512  # the trace's hash block, tokens
RULES = ("greedy", "least_written", "cache_aware", "evict_aware", "future_priced", "belady", "keep_alive")


def prefix_tokens(blocks, tokens, present):
    """Tokens of a `tokens`-token prompt of `blocks` that a cache holding the blocks `present`
    says yes to finds: its leading whole blocks, never the last token (vLLM computes it to
    sample the first output)."""
    k = 0
    for b in blocks:
        if not present(b):
            break
        k += 1
    return min(k * BLOCK, tokens - 1) if k else 0


def load(path, requests, cut):
    """The first `requests` of the trace: (arrival s, prompt tokens, output tokens, blocks)."""
    rows = []
    try:
        with open(path) as f:
            for number, line in enumerate(f, 1):
                r = json.loads(line)
                n = min(r["input_length"], cut)
                rows.append((r["timestamp"], n, r["output_length"], r["hash_ids"][: (n + BLOCK - 1) // BLOCK]))
                if len(rows) == requests:
                    break
    except OSError as e:
        sys.exit(f"{path}: {e}")
    except (ValueError, KeyError, TypeError) as e:
        sys.exit(f"{path}:{number}: not a Mooncake trace line (timestamp, input_length, output_length, hash_ids): {e}")
    if not rows:
        sys.exit(f"{path}: no requests")
    t0 = rows[0][0]
    return [((t - t0) / 1000.0, n, out, blocks) for t, n, out, blocks in rows]


class Fleet:
    """The workers' caches and prefill queues. `next_use(block)` is the request index at which
    a block is next used (only for Belady's eviction; `None`: least recently used first)."""

    def __init__(self, workers, capacity, next_use=None):
        self.capacity = capacity
        self.next_use = next_use
        self.free = [OrderedDict() for _ in range(workers)]  # evictable block -> last use, LRU first
        self.pinned = [{} for _ in range(workers)]  # block -> requests running with it
        self.busy = [0.0] * workers  # when each queue empties, s
        self.written = [0] * workers
        self.in_flight = [0] * workers
        self.ends = []  # (end s, worker, blocks)

    def advance(self, t):
        while self.ends and self.ends[0][0] <= t:
            end, w, blocks = heapq.heappop(self.ends)
            self.in_flight[w] -= 1
            for b in blocks:
                self.pinned[w][b] -= 1
                if self.pinned[w][b] == 0:
                    del self.pinned[w][b]
                    self.free[w][b] = end

    def holds(self, w, block):
        """Whether `block` is in `w`'s cache, evictable or pinned."""
        return block in self.free[w] or block in self.pinned[w]

    def cached(self, w, blocks, tokens):
        """Tokens of the prompt cached on `w` ([`prefix_tokens`])."""
        return prefix_tokens(blocks, tokens, lambda b: self.holds(w, b))

    def evicted(self, w, new_blocks):
        """The blocks storing `new_blocks` more would evict on `w` (least recently used first),
        with their last use."""
        over = len(self.free[w]) + len(self.pinned[w]) + new_blocks - self.capacity
        out = []
        for b, used in self.free[w].items():
            if len(out) >= over:
                break
            out.append((b, used))
        return out

    def evict_one(self, w):
        """Drops one evictable block of `w`: the least recently used, or under Belady's rule
        the one next used furthest ahead."""
        if self.next_use is None:
            self.free[w].popitem(last=False)
        else:
            victim = max(self.free[w], key=self.next_use)
            del self.free[w][victim]

    def touch(self, w, blocks):
        """Marks `blocks` as just used on `w` (those still cached); whether the prefix's first
        block was still there."""
        if not self.holds(w, blocks[0]):
            return False
        for b in blocks:
            if b in self.free[w]:
                self.free[w].move_to_end(b)
        return True

    def place(self, w, t, tokens, out, blocks, hit, ms_per_token, tpot_ms):
        """Books a request of `tokens` prompt tokens, `hit` of them cached, on `w` at `t`; its
        time to first token in the queue model, s."""
        new = tokens - hit
        start = max(t, self.busy[w])
        self.busy[w] = start + new * ms_per_token / 1000.0
        for b in blocks:
            self.free[w].pop(b, None)
            self.pinned[w][b] = self.pinned[w].get(b, 0) + 1
        while len(self.free[w]) + len(self.pinned[w]) > self.capacity and self.free[w]:
            self.evict_one(w)
        self.written[w] += new
        self.in_flight[w] += 1
        heapq.heappush(self.ends, (self.busy[w] + out * tpot_ms / 1000.0, w, blocks))
        return self.busy[w] - t


def run(rows, rule, a, seed, uses):
    """Replays `rows` under `rule`: the hit rate, the queue model's TTFT p90, ms, and the
    touches made. `uses` maps each block to the sorted indices of the requests that use it."""
    rng = random.Random(seed)
    i = 0
    kept = []  # keep_alive: [until s, next touch s, worker, blocks]
    touches = 0

    def next_use(block):
        later = uses[block]
        k = bisect.bisect_right(later, i)
        return later[k] if k < len(later) else len(rows)

    fleet = Fleet(a.workers, a.blocks * a.block_size // BLOCK, next_use if rule == "belady" else None)
    ms = a.prefill_ms_per_token
    hits = total = 0
    ttfts = []
    for i, (t, tokens, out, blocks) in enumerate(rows):
        fleet.advance(t)
        kept = [k for k in kept if k[0] > t]
        for k in kept:
            if k[1] <= t:
                k[1] = t + a.touch_every
                touches += fleet.touch(k[2], k[3])
        cached = [fleet.cached(w, blocks, tokens) for w in range(a.workers)]
        first = [(max(t, fleet.busy[w]) - t) * 1000.0 + (tokens - cached[w]) * ms for w in range(a.workers)]

        def least(costs, tie=lambda w: rng.random()):
            m = min(costs)
            return min((w for w in range(a.workers) if costs[w] <= m + 1e-9), key=tie)

        def eviction_priced(value):
            costs = []
            for w in range(a.workers):
                new_blocks = len(blocks) - (cached[w] + BLOCK - 1) // BLOCK
                lost = sum(1 for b, used in fleet.evicted(w, new_blocks) if value(b, used))
                costs.append(first[w] + lost * BLOCK * ms)
            return least(costs)

        if rule in ("greedy", "belady", "keep_alive"):
            w = least(first)
        elif rule == "least_written":
            w = least(first, tie=lambda w: fleet.written[w])
        elif rule == "cache_aware":
            hi, lo = max(fleet.in_flight), min(fleet.in_flight)
            best = max(range(a.workers), key=lambda w: cached[w])
            # The balance thresholds compare starts vllm-router with (absolute 32, relative 1.1).
            if hi - lo > 32 and hi > 1.1 * lo:
                w = min(range(a.workers), key=lambda w: fleet.in_flight[w])
            elif cached[best] > tokens / 2:
                w = best
            else:
                w = min(range(a.workers), key=lambda w: fleet.written[w])
        elif rule == "evict_aware":
            w = eviction_priced(lambda b, used: t - used < a.young)
        elif rule == "future_priced":
            w = eviction_priced(lambda b, used: uses[b][-1] > i)
        else:
            raise AssertionError(rule)
        hits += cached[w]
        total += tokens
        ttfts.append(fleet.place(w, t, tokens, out, blocks, cached[w], ms, a.tpot_ms) * 1000.0)
        if rule == "keep_alive" and tokens >= a.keep_tokens:
            kept.append([t + a.keep_s, t + a.touch_every, w, blocks])
    ttfts.sort()
    return hits / total, ttfts[int((len(ttfts) - 1) * 0.9)], touches


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace")
    ap.add_argument("--requests", type=int, default=800)
    ap.add_argument("--speedup", type=float, default=5.0)
    ap.add_argument("--cut", type=int, default=16384, help="prompt tokens kept (compare's --max-isl)")
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--blocks", type=int, default=16384, help="KV blocks per worker")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--prefill-ms-per-token", type=float, default=760.0 / 16384, help="vllm-sim's single-prompt prefill")
    ap.add_argument("--tpot-ms", type=float, default=27.0, help="time per output token while running")
    ap.add_argument("--young", type=float, default=16.0, help="evict_aware: a block used within this many seconds is worth keeping")
    ap.add_argument("--keep-tokens", type=int, default=16384, help="keep_alive: the shortest prompt kept")
    ap.add_argument("--keep-s", type=float, default=16.0, help="keep_alive: how long after its arrival a prompt is kept")
    ap.add_argument("--touch-every", type=float, default=2.0, help="keep_alive: seconds between a kept prompt's touches")
    ap.add_argument("--rules", default=",".join(RULES))
    ap.add_argument("--seeds", type=int, default=3, help="draws of the random ties")
    a = ap.parse_args()
    unknown = [r for r in a.rules.split(",") if r not in RULES]
    if unknown:
        sys.exit(f"unknown rule {', '.join(unknown)}: the rules are {', '.join(RULES)}")
    if a.touch_every <= 0:
        sys.exit("--touch-every must be positive")
    if a.speedup <= 0 or a.requests < 1 or a.workers < 1 or a.blocks < 1 or a.seeds < 1 or a.cut < 1:
        sys.exit("--speedup, --requests, --workers, --blocks, --seeds and --cut must be positive")
    rows = [(t / a.speedup, n, out, blocks) for t, n, out, blocks in load(a.trace, a.requests, a.cut)]
    # The requests that use each block, in order: what the future-knowing rules read.
    uses = {}
    for i, (_, _, _, blocks) in enumerate(rows):
        for b in blocks:
            uses.setdefault(b, []).append(i)
    seen, reusable, total = set(), 0, 0
    for _, n, _, blocks in rows:
        reusable += prefix_tokens(blocks, n, seen.__contains__)
        total += n
        seen.update(blocks)
    print(f"{len(rows)} requests; prompt tokens an unbounded single cache would find: {reusable / total:.3f}")
    for rule in a.rules.split(","):
        got = [run(rows, rule, a, s, uses) for s in range(a.seeds)]
        hits = ", ".join(f"{h:.3f}" for h, _, _ in got)
        p90 = ", ".join(f"{p:.0f}" for _, p, _ in got)
        touched = f", touches {', '.join(str(n) for _, _, n in got)}" if rule == "keep_alive" else ""
        print(f"{rule:14s} hit rate {hits}   (queue model's TTFT p90 ms: {p90}{touched})")


if __name__ == "__main__":
    main()
