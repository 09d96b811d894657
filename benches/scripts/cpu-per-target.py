#!/usr/bin/env python3
"""CPU seconds each router and its simulated workers take during a `kvgate-bench compare` run.

On a host the routers, the vllm-sim workers and the bench share, a router's own CPU use can
delay the simulated engine steps (the `sim lag` column). This reads it beside a run:

    benches/scripts/cpu-per-target.py sample OUT.json &    # before the compare; stop it after
    target/release/kvgate-bench compare ...
    kill %1
    benches/scripts/cpu-per-target.py report OUT.json

`sample` reads `/proc/<pid>/stat` once a second for every kvgate, vllm-sim, kvgate-bench,
vllm-router and SMG process (vllm-router renames itself `vllm::router`; the peers are also
found by their launcher's command line) and rewrites OUT.json after each pass, so it holds the
last reading of every process it saw. `report` prints, per router process in start order, its
CPU seconds and those of the eight (or however many) simulators started for it: the ones that
started within 30 s before it and were alive while it was.
"""
import json
import os
import sys
import time

NAMES = {"vllm-sim", "kvgate", "vllm-router", "smg", "kvgate-bench"}
ROUTERS = ("kvgate", "vllm-router", "smg")


def name_of(pid, comm):
    """The process's role, or None for a process not sampled."""
    if "router" in comm:
        return "vllm-router" if "vllm" in comm else "smg"
    if comm in NAMES:
        return comm
    try:
        cmd = open(f"/proc/{pid}/cmdline").read()
    except OSError:
        return None
    if "bin/vllm-router" in cmd:
        return "vllm-router"
    if "bin/smg" in cmd:
        return "smg"
    return None


def sample(out):
    tick = os.sysconf("SC_CLK_TCK")
    seen = {}
    while True:
        now = time.time()
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                stat = open(f"/proc/{pid}/stat").read()
            except OSError:
                continue
            # The name is in parentheses and may hold spaces or ')'.
            comm = stat[stat.index("(") + 1 : stat.rindex(")")]
            role = name_of(pid, comm)
            if role is None:
                continue
            fields = stat[stat.rindex(")") + 2 :].split()
            entry = seen.setdefault(pid, {"comm": role, "first": now})
            entry["last"] = now
            entry["cpu"] = (int(fields[11]) + int(fields[12])) / tick
        with open(out + ".tmp", "w") as f:
            json.dump(seen, f)
        os.replace(out + ".tmp", out)
        time.sleep(1)


def report(path):
    procs = sorted(json.load(open(path)).values(), key=lambda p: p["first"])
    sims = [p for p in procs if p["comm"] == "vllm-sim"]
    for r in (p for p in procs if p["comm"] in ROUTERS):
        mine = [s for s in sims if r["first"] - 30 <= s["first"] <= r["last"] and s["last"] >= r["first"]]
        print(f"{r['comm']:12s} alive {r['last'] - r['first']:5.0f} s  router {r['cpu']:6.1f} s  simulators ({len(mine)}) {sum(s['cpu'] for s in mine):6.1f} s")
    bench = [p["cpu"] for p in procs if p["comm"] == "kvgate-bench"]
    if bench:
        print(f"kvgate-bench {' '.join(f'{c:.1f} s' for c in bench)}")


def main():
    if len(sys.argv) != 3 or sys.argv[1] not in ("sample", "report"):
        sys.exit(__doc__)
    sample(sys.argv[2]) if sys.argv[1] == "sample" else report(sys.argv[2])


if __name__ == "__main__":
    main()
