#!/usr/bin/env bash
# Instructions per routing decision, by part, counted by callgrind: the repeatable figure for
# comparing two builds of the decision on a shared host, whose wall-clock microseconds move with
# its neighbours (routing-decision prints a hash-alone probe to show when they do). It runs
# routing-decision under callgrind (a few minutes) and prints, for the function that makes each
# decision, each part it calls: its calls and the instructions per call, inclusive. Every call
# there is on the bench's 8,192-token prompt; `choose` is averaged over the three costs the
# bench measures (`time`, `time` with everything priced, `blocks`). Building the 64 candidates
# from the ledger is inlined into the bench's own code, among its bookkeeping parts, and is not
# counted here.
#
#   sudo apt-get install -y valgrind
#   cargo build --release -p kvgate-bench
#   benches/scripts/decision-instructions.sh target/release/routing-decision
set -euo pipefail
BIN=$(realpath "${1:-target/release/routing-decision}")
OUT=${OUT:-$(mktemp -d)}
command -v valgrind >/dev/null || { echo "needs valgrind (apt-get install -y valgrind)" >&2; exit 2; }
valgrind --tool=callgrind --callgrind-out-file="$OUT/callgrind.out" "$BIN" > "$OUT/run.log" 2>&1
callgrind_annotate --tree=calling --inclusive=yes "$OUT/callgrind.out" > "$OUT/tree.txt"
python3 - "$OUT/tree.txt" <<'PY'
import re, sys
blocks = open(sys.argv[1]).read().split("\n\n")
row = re.compile(r"^\s*([\d,]+) \([\s\d.%]+\)\s+>\s+\S+?:(.*) \(([\d,]+)x\)")
num = lambda s: int(s.replace(",", ""))
for b in blocks:
    lines = b.strip().splitlines()
    if not lines or "*" not in lines[0] or "routing_decision::main::{{closure}}" not in lines[0]:
        continue
    calls = [row.match(l) for l in lines[1:]]
    calls = [(m.group(2).split(" [")[0], num(m.group(1)), num(m.group(3))) for m in calls if m]
    if not any("choose" in f for f, _, _ in calls):
        continue
    parts = ("Hasher::chain", "find_matches", "Ledger::overlap", "choose")
    print(f"{'part':<28} {'calls':>9} {'instructions per call':>22}")
    total = 0
    for f, ir, n in calls:
        name = next((p for p in parts if p in f), None)
        if name:
            total += ir / n
            print(f"{name:<28} {n:>9,} {ir / n:>22,.0f}")
    print(f"{'sum':<28} {'':>9} {total:>22,.0f}")
PY
echo "profile: $OUT/callgrind.out"
