#!/usr/bin/env python3
"""Where a kvgate run's first-token tail came from: each request's routing decision joined to its
measured outcome.

kvgate logs, at debug level, every candidate's predicted terms for each `kv` decision
(`kvgate_filters::route::kv`, "kv routing") and each request's end with the worker that served
it and the first token predicted there (`kvgate::request::record`, "request done"). This script
joins the two by request id and reads the requests at or above a TTFT percentile: how far past
the least predicted first token they were placed, which cost terms the chosen worker saved
against the one with the least first token, and how close the prediction came.

    KVGATE_LOG=warn,kvgate_filters::route::kv=debug,kvgate::request::record=debug \\
        target/release/kvgate-bench compare --targets kvgate-kv ... --out benches/out/run
    benches/scripts/decisions-join.py benches/out/run/logs/kvgate-kv.log --percentile 90

A request placed more than once (a retry, a move) is read at its last placement.
"""
import argparse
import re
import statistics
import sys

ANSI = re.compile(r"\x1b\[[0-9;]*m")
DECISION = re.compile(r'request_id="([^"]+)" worker=(\d+) overlap=(\d+) terms=Time\(Prediction \{(.*)\}\) cost=(\S+)')
DONE = re.compile(r'request_id="([^"]+)".*?status=(\d+).*?ttft_ms=(\d+)(?:.*?worker=(\d+))?(?:.*?predicted_ttft_ms=([\d.]+))?')
TERMS = ("slowdown_ms", "behind_ms", "duplicate_ms", "ahead_ms", "wait_ms", "prefill_ms", "join_ms")


def ttft_of(terms):
    """The predicted time to first token in a decision's terms (`Prediction::ttft_ms`)."""
    return terms["join_ms"] + terms["wait_ms"] + terms["prefill_ms"] + terms["steps_ms"]


def parse(path):
    """Each request's candidates (the last decision's) and its outcome, in arrival order."""
    decisions, done, order = {}, {}, []
    with open(path, errors="replace") as f:
        for raw in f:
            line = ANSI.sub("", raw)
            if "kv routing" in line:
                m = DECISION.search(line)
                if not m:
                    continue
                rid, worker, overlap, body, cost = m.groups()
                terms = {k.strip(): float(v) for k, v in (kv.split(":", 1) for kv in body.split(","))}
                terms.update(worker=int(worker), overlap=int(overlap), cost=float(cost))
                cands = decisions.setdefault(rid, [])
                if cands and any(c["worker"] == terms["worker"] for c in cands):
                    cands.clear()  # a later placement of the same request: keep the last
                if not cands:
                    order.append(rid)
                cands.append(terms)
            elif "request done" in line:
                m = DONE.search(line)
                if m and m.group(2) == "200":
                    rid, _, ttft, worker, predicted = m.groups()
                    done[rid] = (float(ttft), None if worker is None else int(worker), None if predicted is None else float(predicted))
    return [(rid, decisions[rid], done[rid]) for rid in dict.fromkeys(order) if rid in done]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("log", help="kvgate's log of the run (compare writes it to <out>/logs/kvgate-<mode>.log)")
    ap.add_argument("--percentile", type=float, default=90.0, help="read the requests at or above this TTFT percentile")
    ap.add_argument("--trade-ms", type=float, default=50.0, help="count a request as traded when placed this far past its least predicted first token")
    a = ap.parse_args()
    rows = parse(a.log)
    if not rows:
        sys.exit(f"{a.log}: no `kv routing` decisions joined to a `request done` line (is KVGATE_LOG set as the doc says?)")
    ttfts = sorted(r[2][0] for r in rows)
    cut = ttfts[min(len(ttfts) - 1, int(a.percentile / 100 * len(ttfts)))]
    tail = [r for r in rows if r[2][0] >= cut]
    print(f"{len(rows)} requests joined; TTFT p{a.percentile:g} {cut:.0f} ms; {len(tail)} at or above it")

    def chosen(cands, outcome):
        worker = outcome[1]
        picked = [c for c in cands if c["worker"] == worker] if worker is not None else []
        return picked[0] if picked else min(cands, key=lambda c: c["cost"])

    traded = 0
    sums = {k: [0.0, 0.0] for k in TERMS}
    pred, least, measured, errors = [], [], [], []
    for _, cands, outcome in tail:
        c = chosen(cands, outcome)
        best = min(cands, key=ttft_of)
        traded += ttft_of(c) - ttft_of(best) > a.trade_ms
        for k in TERMS:
            sums[k][0] += c.get(k, 0.0)
            sums[k][1] += best.get(k, 0.0)
        pred.append(ttft_of(c))
        least.append(ttft_of(best))
        measured.append(outcome[0])
    for _, cands, outcome in rows:
        # The prediction kvgate logged for the serving worker; logs without it: the chosen one's.
        predicted = outcome[2] if outcome[2] is not None else ttft_of(chosen(cands, outcome))
        errors.append(outcome[0] - predicted)
    n = len(tail)
    print(f"placed more than {a.trade_ms:g} ms past their least predicted first token: {traded} of {n}")
    print(f"predicted TTFT at the chosen worker {statistics.mean(pred):.0f} ms, at the least one {statistics.mean(least):.0f} ms, measured {statistics.mean(measured):.0f} ms (means over the tail)")
    print("terms, mean over the tail: chosen worker / worker with the least first token")
    for k in TERMS:
        print(f"  {k:13s} {sums[k][0] / n:9.0f} / {sums[k][1] / n:9.0f}")
    print(f"measured − predicted TTFT at the chosen worker, all requests: median {statistics.median(errors):.0f} ms, p90 of |error| {sorted(abs(e) for e in errors)[int(0.9 * (len(errors) - 1))]:.0f} ms")


if __name__ == "__main__":
    main()
