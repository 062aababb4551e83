#!/usr/bin/env bash
# Runs every cargo-fuzz target in fuzz/ for SECONDS each (default 60).
#
#   tools/fuzz.sh [SECONDS]
#
# Needs the nightly toolchain; installs cargo-fuzz if it is missing. Each
# target starts from its committed seeds (fuzz/seeds/<target>, read only) and
# a working corpus (fuzz/corpus/<target>, git-ignored) where new inputs go, so
# the seeds stay clean. Crashing inputs land in fuzz/artifacts/<target>/.
# Exits non-zero if any target crashed (every target is still run). The
# targets run side by side, FUZZ_JOBS at a time (default: one per core);
# each one's output is shown only if it crashed.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
root=$(pwd)
secs="${1:-60}"
case "$secs" in
    '' | *[!0-9]*) echo "usage: $0 [SECONDS]" >&2; exit 2 ;;
esac

# cargo-fuzz needs nightly features: the nightly toolchain where rustup has
# one, else the stable compiler with RUSTC_BOOTSTRAP (same flags).
if rustup toolchain list 2>/dev/null | grep -q '^nightly'; then
    fuzz=(cargo +nightly fuzz)
else
    echo "fuzz.sh: no nightly toolchain; using stable with RUSTC_BOOTSTRAP=1" >&2
    export RUSTC_BOOTSTRAP=1
    fuzz=(cargo fuzz)
fi

if ! cargo fuzz --version >/dev/null 2>&1; then
    echo "fuzz.sh: installing cargo-fuzz" >&2
    cargo install cargo-fuzz --locked
fi

targets=(parse spec rows replica)
# Targets run side by side, one per core (FUZZ_JOBS, default every core):
# each gets SECONDS of one core, as it would alone, in less wall time. The
# build comes first, once, so that the runs do not race to build.
jobs="${FUZZ_JOBS:-$(nproc)}"
case "$jobs" in
    '' | *[!0-9]* | 0) echo "fuzz.sh: FUZZ_JOBS must be a positive number, got '$jobs'" >&2; exit 2 ;;
esac
"${fuzz[@]}" build --fuzz-dir "$root/fuzz"
logs=$(mktemp -d)
trap 'rm -rf "$logs"' EXIT
run_one() {
    local t=$1
    local corpus="$root/fuzz/corpus/$t" seeds="$root/fuzz/seeds/$t"
    mkdir -p "$corpus"
    if "${fuzz[@]}" run --fuzz-dir "$root/fuzz" "$t" "$corpus" "$seeds" -- \
        -max_total_time="$secs" -timeout=10 -print_final_stats=1 >"$logs/$t.log" 2>&1; then
        echo ok >"$logs/$t.rc"
    else
        echo failed >"$logs/$t.rc"
    fi
}
running=0
for t in "${targets[@]}"; do
    echo "=== fuzz target $t: ${secs}s ===" >&2
    run_one "$t" &
    running=$((running + 1))
    if ((running >= jobs)); then
        wait -n || true
        running=$((running - 1))
    fi
done
wait
failed=()
for t in "${targets[@]}"; do
    if [ "$(cat "$logs/$t.rc" 2>/dev/null)" != ok ]; then
        failed+=("$t")
        echo "=== fuzz target $t: its output ===" >&2
        cat "$logs/$t.log" >&2
    else
        # Its final stats: runs, coverage, corpus.
        grep -E '^(stat::number_of_executed_units|stat::peak_rss_mb|#[0-9]+ +DONE)' "$logs/$t.log" \
            | sed "s/^/$t: /" >&2 || true
    fi
done

if ((${#failed[@]})); then
    echo "fuzz.sh: crashes in: ${failed[*]} (inputs under fuzz/artifacts/)" >&2
    exit 1
fi
echo "fuzz.sh: no crashes in ${targets[*]} (${secs}s each, $jobs at a time)" >&2
