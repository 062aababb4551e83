#!/usr/bin/env bash
# Packs what tools/bench-16core/run.sh needs on a machine that has neither
# Rust nor DPDK (the lent 16-core machine, BENCHMARKS.md "On 16 cores"):
# stripped release binaries, dpdk-testpmd, the DPDK libraries and the few
# poll-mode drivers phub uses (af_packet, memif, ring), every shared library
# they load (the target installs only those it lacks), `ip`, and the Python
# package `phub` (abi3: any CPython >= 3.11). Writes .bench16/bundle.tar.xz
# (ignored by git: add `/.bench16/` to .git/info/exclude).
#
#   cargo build --release -p phub-dataplane --example dpdk_memif_gen
#   cargo build --release -p phub-engine --example bsp_round_bench   (optional: run.sh's "sparse")
#   cargo build --release -p phub -p phub-tools -p phub-hwtests --bins
#   make python-venv       # for the phub Python package (or make torch-venv)
#   tools/bench-16core/bundle.sh
#
# OLD_BINS=DIR (with OLD_COMMIT=sha) also packs DIR's phub-bench and
# phub-dataplane as old/bin (another commit's build): run.sh's "lcores-ab"
# step runs the lcore sweep with both, alternating, on the same machine.
# BISECT_DIRS="DIR..." packs each DIR's phub-bench, phub-dataplane and
# phub-control (those it has) as bisect/NAME/ (NAME: the DIR's last part,
# e.g. a commit): run.sh's "bisect" step runs each. SLIM=1 packs only
# what that step needs (phub-bench and phub-dataplane, here and in each
# DIR; the libraries), to fit the device tool's 64 MiB with many builds.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUTDIR=.bench16
STAGE=$(mktemp -d /tmp/phub-bench16.XXXXXX)
trap 'rm -rf "$STAGE"' EXIT
PMDS=/usr/lib/x86_64-linux-gnu/dpdk/pmds-23.0
mkdir -p "$STAGE/bin" "$STAGE/lib" "$STAGE/pmds" "$STAGE/py"

bins="phub-dataplane phub-control phubctl phub-bench phub-rack-agent examples/dpdk_memif_gen"
[[ -n "${SLIM:-}" ]] && bins="phub-dataplane phub-bench"
[[ -z "${SLIM:-}" && -f target/release/examples/bsp_round_bench ]] && bins="$bins examples/bsp_round_bench"
for b in $bins; do
  strip -o "$STAGE/bin/$(basename "$b")" "target/release/$b"
done
if [[ -n "${OLD_BINS:-}" ]]; then
  mkdir -p "$STAGE/old/bin"
  for b in phub-bench phub-dataplane; do strip -o "$STAGE/old/bin/$b" "$OLD_BINS/$b"; done
  echo "${OLD_COMMIT:-?}" >"$STAGE/old/COMMIT"
fi
for d in ${BISECT_DIRS:-}; do
  n=$(basename "$d")
  mkdir -p "$STAGE/bisect/$n"
  for b in phub-bench phub-dataplane ${SLIM:+-}phub-control; do
    [[ -f "$d/$b" ]] && strip -o "$STAGE/bisect/$n/$b" "$d/$b"
  done
done
[[ -n "${SLIM:-}" ]] || cp "$(command -v dpdk-testpmd)" "$(command -v ip)" "$STAGE/bin/"
for d in net_af_packet net_memif net_ring mempool_ring mempool_stack bus_vdev; do
  cp -L "$PMDS/librte_$d.so.23" "$STAGE/pmds/"
done
# Every library the binaries and drivers load, except the C library itself.
. tools/bundle-common.sh
bundle_libs "$STAGE/lib" "$STAGE"/bin/* "$STAGE"/pmds/* $(ls "$STAGE"/old/bin/* "$STAGE"/bisect/*/* 2>/dev/null)
[[ -n "${SLIM:-}" ]] || bundle_phub_py "$STAGE/py"
mkdir -p "$OUTDIR"
tar -C "$STAGE" -cJf "$OUTDIR/bundle.tar.xz" .
ls -la "$OUTDIR/bundle.tar.xz"
