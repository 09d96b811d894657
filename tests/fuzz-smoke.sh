#!/usr/bin/env bash
# Every fuzz target (fuzz/, docs/fuzzing.md) for a short time on its seeds and corpus: what CI
# runs after the tests. A crash, a panic, a timeout or an allocation past the limit fails it,
# and libFuzzer leaves the input in fuzz/artifacts/<target>/.
#   FUZZ_SECONDS   seconds per target (default 20)
#   FUZZ_FLAGS     build flags (default "--dev -s none": a quick build; long runs use "-O -s none")
#   FUZZ_CLEAN=1   remove the fuzz build afterwards (CI: its disk is needed by what follows)
set -euo pipefail
cd "$(dirname "$0")/../fuzz"
seconds="${FUZZ_SECONDS:-20}"
read -r -a flags <<< "${FUZZ_FLAGS:---dev -s none}"
rustup run nightly rustc --version >/dev/null 2>&1 || rustup toolchain install nightly --profile minimal
command -v cargo-fuzz >/dev/null || cargo install cargo-fuzz --version 0.13.2 --locked
cargo +nightly fuzz build "${flags[@]}"
for target in $(cargo +nightly fuzz list); do
  mkdir -p "corpus/$target"
  echo "== $target: ${seconds} s"
  log="$(mktemp -t "fuzz-$target.XXXXXX.log")"
  if ! cargo +nightly fuzz run "${flags[@]}" "$target" "corpus/$target" "seeds/$target" -- \
      -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 -max_len=131072 -print_final_stats=1 >"$log" 2>&1; then
    tail -60 "$log"
    echo "fuzz smoke: $target found a failing input (fuzz/artifacts/$target/)"
    exit 1
  fi
  grep -E '^stat::(number_of_executed_units|peak_rss_mb)' "$log" || true
  rm -f "$log"
done
if [ "${FUZZ_CLEAN:-0}" = 1 ]; then
  rm -rf target
fi
echo "fuzz smoke: every target ran ${seconds} s without a finding"
