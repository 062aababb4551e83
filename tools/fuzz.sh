#!/usr/bin/env bash
# Runs every cargo-fuzz target in fuzz/ for SECONDS each (default 60).
#
#   tools/fuzz.sh [SECONDS]
#
# Needs the nightly toolchain; installs cargo-fuzz if it is missing. Each
# target starts from its committed seeds (fuzz/seeds/<target>, read only) and
# a working corpus (fuzz/corpus/<target>, git-ignored) where new inputs go, so
# the seeds stay clean. Crashing inputs land in fuzz/artifacts/<target>/.
# Exits non-zero if any target crashed (every target is still run).
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
failed=()
for t in "${targets[@]}"; do
    corpus="$root/fuzz/corpus/$t"
    seeds="$root/fuzz/seeds/$t"
    mkdir -p "$corpus"
    echo "=== fuzz target $t: ${secs}s ===" >&2
    if ! "${fuzz[@]}" run --fuzz-dir "$root/fuzz" "$t" "$corpus" "$seeds" -- \
        -max_total_time="$secs" -timeout=10 -print_final_stats=1; then
        failed+=("$t")
    fi
done

if ((${#failed[@]})); then
    echo "fuzz.sh: crashes in: ${failed[*]} (inputs under fuzz/artifacts/)" >&2
    exit 1
fi
echo "fuzz.sh: no crashes in ${targets[*]} (${secs}s each)" >&2
