#!/usr/bin/env python3
"""How likely a router is to pass "each of N runs within X% of the best peer on every figure",
read from the runs already measured.

An acceptance of that form is a statement about noise as much as about routing: each figure of
each router moves from run to run, and the best peer on a figure is the least of several noisy
draws. This script reads `kvgate-bench compare` results (`results.json` of each run), and for
one router against the others in those runs prints:

- each router's mean and relative spread (sample standard deviation over mean) per figure;
- the runs that hold every router: which figures the router passed in each;
- each peer against the router in the runs that hold both: the geometric mean of the peer's
  figure over the router's, the standard error of the mean log ratio behind it, and in how many
  runs the peer's was lower (the fair comparison when runs differ, e.g. by the workload's seed);
- the odds that one run, and N runs, pass, drawing each router's figures from its own measured
  runs (a bootstrap: one whole measured run per router per draw, so a router's figures move
  together as they did), as measured and with the router's figures scaled down by a lead.

    benches/scripts/acceptance-odds.py benches/out/e*/results.json --router kvgate-kv \\
        --peers vllm-router-kv_aware,vllm-router-cache_aware,smg-cache_aware --runs 3

Runs whose router is missing, or that served fewer requests than the most any run served for
that router, are left out (a failed or shortened run is not a draw of the same experiment).
With `--max-lag S`, so is a router's run whose vllm-sim workers fell more than S seconds behind
their simulated clocks in all (`sim_lag_s`, recorded by kvgate-bench since the simulator counts
it): there the host, not the router, stretched the steps. The means table gives each router's
mean lag over its kept runs.
"""
import argparse
import json
import math
import random
import statistics
import sys

FIGURES = (("ttft_ms", "p50"), ("ttft_ms", "p90"), ("ttft_ms", "p99"), ("tpot_ms", "p90"), ("e2e_ms", "p90"), ("e2e_ms", "p99"))
NAMES = ("TTFT p50", "TTFT p90", "TTFT p99", "TPOT p90", "E2E p90", "E2E p99")


def load(paths, labels, max_lag=None):
    """Each run's figures per router label, for the labels asked for, and each kept router's
    simulator lag per run (`lags[(path, label)]`, where the file records it). A run of another
    workload (another request count), a router that failed requests, served fewer than its
    fullest run or lagged more than `max_lag` s, and a label given twice in one file are left
    out, each with a line on stderr."""
    runs = []
    for path in paths:
        try:
            with open(path) as f:
                results = json.load(f)
            if not isinstance(results, list):
                raise ValueError("not a list of targets (a `compare` results.json)")
            run = {}
            for r in results:
                if r.get("label") not in labels:
                    continue
                if r["label"] in run:
                    print(f"{path}: {r['label']} twice, the first kept", file=sys.stderr)
                    continue
                lag = r.get("sim_lag_s")
                run[r["label"]] = (r["requests"], r["ok"], r.get("errors", 0), [float(r[a][b]) for a, b in FIGURES], None if lag is None else float(lag))
        except (OSError, ValueError, KeyError, TypeError) as e:
            print(f"{path}: skipped ({e})", file=sys.stderr)
            continue
        if run:
            runs.append((path, run))
    workloads = {v[0] for _, run in runs for v in run.values()}
    if len(workloads) > 1:
        sys.exit(f"runs of different workloads ({', '.join(str(n) for n in sorted(workloads))} requests): pass one workload's files")
    # A run that failed requests, or served fewer than the router's fullest run, is not a draw of
    # the same experiment.
    most = {lab: max((run[lab][1] for _, run in runs if lab in run), default=0) for lab in labels}
    kept, lags = [], {}
    for path, run in runs:
        figures = {}
        for lab, (_, ok, errors, values, lag) in run.items():
            if errors or ok < most[lab]:
                print(f"{path}: {lab} left out ({ok} ok, {errors} errors)", file=sys.stderr)
            elif max_lag is not None and lag is not None and lag > max_lag:
                print(f"{path}: {lab} left out (its workers lagged {lag:.2f} s)", file=sys.stderr)
            else:
                figures[lab] = values
                if lag is not None:
                    lags[(path, lab)] = lag
        kept.append((path, figures))
    return kept, lags


def passes(mine, peers, tolerance):
    """Per figure: whether `mine` is within `tolerance` of the least of `peers`."""
    return [mine[i] <= (1.0 + tolerance) * min(p[i] for p in peers) for i in range(len(FIGURES))]


def paired(runs, router, peer):
    """Per figure over the runs holding both: the peer's figure over the router's as a geometric
    mean less one, the standard error of the mean log ratio it is read from (None under two
    runs), the runs where the peer's was lower, and the runs compared (a run where either
    figure is not positive has no ratio and is not counted); None for a figure no run compares."""
    pairs = [(run[router], run[peer]) for _, run in runs if router in run and peer in run]
    out = []
    for i in range(len(FIGURES)):
        logs = [math.log(q[i] / r[i]) for r, q in pairs if r[i] > 0 and q[i] > 0]
        if not logs:
            out.append(None)
            continue
        se = statistics.stdev(logs) / math.sqrt(len(logs)) if len(logs) > 1 else None
        out.append((math.exp(statistics.mean(logs)) - 1.0, se, sum(x < 0 for x in logs), len(logs)))
    return out


def fit_at_equal_lag(runs, lags, router, peer):
    """Per figure over the runs holding both routers with lag recorded: the least-squares line of
    the log of the peer's figure over the router's against the peer's lag less the router's, as
    (the line at equal lag as a ratio less one, its standard error, the change per second of lag
    as a ratio less one, the correlation, runs fitted); None under four runs or when the lag
    differences do not differ."""
    pairs = [
        (lags[(p, peer)] - lags[(p, router)], run[router], run[peer])
        for p, run in runs
        if router in run and peer in run and (p, router) in lags and (p, peer) in lags
    ]
    out = []
    for i in range(len(FIGURES)):
        pts = [(d, math.log(q[i] / r[i])) for d, r, q in pairs if r[i] > 0 and q[i] > 0]
        n = len(pts)
        if n < 4:
            out.append(None)
            continue
        mx = statistics.mean(x for x, _ in pts)
        my = statistics.mean(y for _, y in pts)
        sxx = sum((x - mx) ** 2 for x, _ in pts)
        syy = sum((y - my) ** 2 for _, y in pts)
        if sxx <= 0:
            out.append(None)
            continue
        slope = sum((x - mx) * (y - my) for x, y in pts) / sxx
        at_zero = my - slope * mx
        resid = sum((y - at_zero - slope * x) ** 2 for x, y in pts) / (n - 2)
        se = math.sqrt(resid * (1.0 / n + mx * mx / sxx))
        r = slope * math.sqrt(sxx / syy) if syy > 0 else 0.0
        out.append((math.exp(at_zero) - 1.0, se, math.exp(slope) - 1.0, r, n))
    return out


def odds(draws, router, peers, tolerance, lead, trials, rng):
    """The share of simulated runs that pass every figure, and each figure's share, with the
    router's figures scaled by `1 - lead`."""
    every, each = 0, [0] * len(FIGURES)
    for _ in range(trials):
        mine = [x * (1.0 - lead) for x in rng.choice(draws[router])]
        ok = passes(mine, [rng.choice(draws[p]) for p in peers], tolerance)
        every += all(ok)
        each = [n + o for n, o in zip(each, ok)]
    return every / trials, [n / trials for n in each]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results", nargs="+", help="results.json files of `kvgate-bench compare` runs of one workload")
    ap.add_argument("--router", default="kvgate-kv", help="the router judged (a target label)")
    ap.add_argument("--peers", default="vllm-router-kv_aware,vllm-router-cache_aware,smg-cache_aware", help="comma-separated peer labels")
    ap.add_argument("--tolerance", type=float, default=0.02, help="how far behind the best peer a figure may be (0.02: 2%%)")
    ap.add_argument("--runs", type=int, default=3, help="runs that must each pass")
    ap.add_argument("--trials", type=int, default=20000)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--max-lag", type=float, default=None, help="leave out a router's run whose workers lagged more than this many seconds in all")
    a = ap.parse_args()
    peers = [p for p in a.peers.split(",") if p]
    if not peers:
        sys.exit("--peers names no peer")
    if a.trials < 1 or a.runs < 1 or a.tolerance < 0:
        sys.exit("--trials and --runs must be positive, --tolerance not negative")
    labels = [a.router, *peers]
    runs, lags = load(a.results, set(labels), a.max_lag)
    draws = {lab: [run[lab] for _, run in runs if lab in run] for lab in labels}
    missing = [lab for lab, d in draws.items() if len(d) < 2]
    if missing:
        sys.exit(f"fewer than two runs for {', '.join(missing)}: no spread to read")

    print(f"{'router':28s} runs " + " ".join(f"{n:>17s}" for n in NAMES) + f" {'sim lag':>8s}")
    for lab in labels:
        d = draws[lab]
        cells = []
        for i in range(len(FIGURES)):
            xs = [r[i] for r in d]
            m = statistics.mean(xs)
            cells.append(f"{m:9.1f} ±{100 * statistics.stdev(xs) / m:4.1f}%")
        lag = [v for (_, l), v in lags.items() if l == lab]
        lag_cell = f"{statistics.mean(lag):6.2f} s" if lag else "-"
        print(f"{lab:28s} {len(d):4d} " + " ".join(f"{c:>17s}" for c in cells) + f" {lag_cell:>8s}")

    full = [(p, run) for p, run in runs if all(lab in run for lab in labels)]
    print(f"\nruns holding every router: {len(full)}")
    for p, run in full:
        ok = passes(run[a.router], [run[q] for q in peers], a.tolerance)
        missed = [n for n, o in zip(NAMES, ok) if not o]
        print(f"  {p}: {'passes' if all(ok) else 'misses ' + ', '.join(missed)}")

    print(f"\neach peer against {a.router} in the same runs (peer / router - 1; ± the standard error of the mean log ratio; runs the peer was lower of those compared):")
    for q in peers:
        text = ", ".join(
            f"{name} -" if c is None else f"{name} {100 * c[0]:+.1f}%" + ("" if c[1] is None else f" ±{100 * c[1]:.1f}") + f" ({c[2]}/{c[3]})"
            for name, c in zip(NAMES, paired(runs, a.router, q))
        )
        print(f"  {q:28s} {text}")

    print(f"\nthe same at equal simulator lag (fitted against the peer's lag less {a.router}'s; ± the standard error at equal lag; change per second of lag; correlation; runs):")
    for q in peers:
        fits = fit_at_equal_lag(runs, lags, a.router, q)
        text = ", ".join(
            f"{name} -" if f is None else f"{name} {100 * f[0]:+.1f}% ±{100 * f[1]:.1f} ({100 * f[2]:+.2f}%/s, r={f[3]:.2f}, {f[4]})"
            for name, f in zip(NAMES, fits)
        )
        print(f"  {q:28s} {text}")

    rng = random.Random(a.seed)
    print(f"\nodds of passing, each router's figures drawn from its measured runs ({a.trials} draws):")
    for lead in (0.0, 0.02, 0.05, 0.07, 0.10):
        one, each = odds(draws, a.router, peers, a.tolerance, lead, a.trials, rng)
        label = "as measured" if lead == 0.0 else f"{100 * lead:.0f}% lower on every figure"
        per = ", ".join(f"{n} {100 * x:.0f}%" for n, x in zip(NAMES, each))
        print(f"  {label:28s} one run {100 * one:5.1f}%, {a.runs} runs {100 * one ** a.runs:5.1f}% ({per})")


if __name__ == "__main__":
    main()
