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
BIN=${1:-target/release/routing-decision}
[ -x "$BIN" ] || { echo "no routing-decision binary at $BIN (cargo build --release -p kvgate-bench)" >&2; exit 2; }
BIN=$(realpath "$BIN")
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT"
command -v valgrind >/dev/null || { echo "needs valgrind (apt-get install -y valgrind)" >&2; exit 2; }
if ! valgrind --tool=callgrind --callgrind-out-file="$OUT/callgrind.out" "$BIN" > "$OUT/run.log" 2>&1; then
    tail -20 "$OUT/run.log" >&2
    echo "routing-decision failed under callgrind (log: $OUT/run.log)" >&2
    exit 1
fi
callgrind_annotate --tree=calling --inclusive=yes "$OUT/callgrind.out" > "$OUT/tree.txt"
python3 - "$OUT/tree.txt" <<'PY'
import re, sys
blocks = open(sys.argv[1]).read().split("\n\n")
row = re.compile(r"^\s*([\d,]+) \([\s\d.%]+\)\s+>\s+\S+?:(.*?) \(([\d,]+)x\)")
num = lambda s: int(s.replace(",", ""))
# Each part by the exact end of its symbol: a part inlined into the decision (a build whose
# inlining changed) has no call of its own, and the count would silently leave it out.
parts = {"hash": "::Hasher::chain", "index": ">::find_matches", "booked overlap": "::Ledger::overlap", "choose": ">::choose"}
for b in blocks:
    lines = b.strip().splitlines()
    if not lines or "*" not in lines[0] or "routing_decision::main::{{closure}}" not in lines[0]:
        continue
    calls = [(m.group(2), num(m.group(1)), num(m.group(3))) for m in map(row.match, lines[1:]) if m]
    found = {name: (ir, n) for name, end in parts.items() for f, ir, n in calls if f.endswith(end)}
    if "choose" not in found:
        continue
    missing = [name for name in parts if name not in found]
    if missing:
        sys.exit(f"parts not called from the decision (inlined?): {', '.join(missing)}")
    print(f"{'part':<16} {'calls':>9} {'instructions per call':>22}")
    for name, (ir, n) in found.items():
        print(f"{name:<16} {n:>9,} {ir / n:>22,.0f}")
    print(f"{'sum':<16} {'':>9} {sum(ir / n for ir, n in found.values()):>22,.0f}")
    sys.exit(0)
sys.exit("no decision found in the profile")
PY
echo "profile: $OUT/callgrind.out"
