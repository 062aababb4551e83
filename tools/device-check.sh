#!/usr/bin/env bash
# Issue 37's checks in one call of the device tool (one NVIDIA GPU, 16
# cores, no network, no Rust, no DPDK): tools/gpu-bench.sh run (phub.torch
# on CUDA tensors, against gloo and NCCL), then tools/bench-16core/run.sh
# with STEPS="lcores" (the dataplane's lcore scaling on the ResNet-50
# exchange) and, if time is left, STEPS="ring" (the DPDK ring port). Each
# part runs under its own timeout and the results are packed into four
# files, since the tool brings back at most eight (PARTS="lcores ring" by
# default: which of the 16-core parts run after the GPU's; "lcores-ab
# lcores-dpdk" instead of "lcores" runs run.sh's steps of those names;
# PLAN=repeat goes to gpu-bench.sh):
#
#   $OUT/gpu-summary.txt  $OUT/gpu-logs.tar.xz
#   $OUT/cores-summary.txt  $OUT/cores-results.tar.xz
#
# Here, first (release binaries, the Python package, both bundles):
#   make release-bins python-venv
#   cargo build --release -p phub-dataplane --example dpdk_memif_gen
#   cargo build --release -p phub -p phub-tools -p phub-hwtests --bins
#   tools/gpu-bench.sh bundle && tools/bench-16core/bundle.sh
# There (run tool, carry [".gpubench", ".bench16"], timeout_s 560):
#   OUT=$OUT COMMIT=<commit> tools/device-check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:?set OUT to a folder for the results}
mkdir -p "$OUT"
t0=$(date +%s)
G=$(mktemp -d /tmp/phub-device-gpu.XXXXXX)
C=$(mktemp -d /tmp/phub-device-cores.XXXXXX)

timeout "${GPU_S:-300}" env OUT="$G" tools/gpu-bench.sh run
echo "== gpu-bench.sh rc=$? after $(($(date +%s) - t0)) s" >>"$G/summary.txt"
cp "$G/summary.txt" "$OUT/gpu-summary.txt"
tar -C "$G" -cJf "$OUT/gpu-logs.tar.xz" .

left=$(( ${TOTAL_S:-520} - ($(date +%s) - t0) ))
if [[ " ${PARTS:-lcores ring} " == *" lcores"* ]] && (( left > 60 )); then
  # "lcores", or "lcores-ab lcores-dpdk" (run.sh's steps of those names)
  steps=$(tr ' ' '\n' <<<"${PARTS:-lcores ring}" | grep '^lcores' | tr '\n' ' ')
  timeout "$((left > ${CORES_S:-170} ? ${CORES_S:-170} : left))" env OUT="$C" STEPS="$steps" COMMIT="${COMMIT:-?}" tools/bench-16core/run.sh
  echo "== bench-16core lcores rc=$? after $(($(date +%s) - t0)) s" >>"$C/summary.txt"
fi
left=$(( ${TOTAL_S:-520} - ($(date +%s) - t0) ))
if [[ " ${PARTS:-lcores ring} " == *" ring "* ]] && (( left > 60 )); then
  mv "$C/summary.txt" "$C/summary-lcores.txt" 2>/dev/null
  timeout "$left" env OUT="$C" STEPS=ring RING_PAIRS=20 MEMIF_RUNS=1 COMMIT="${COMMIT:-?}" tools/bench-16core/run.sh
  echo "== bench-16core ring rc=$? after $(($(date +%s) - t0)) s" >>"$C/summary.txt"
  cat "$C/summary.txt" >>"$C/summary-lcores.txt" && mv "$C/summary-lcores.txt" "$C/summary.txt"
fi
cp "$C/summary.txt" "$OUT/cores-summary.txt" 2>/dev/null
# run.sh packs its results at its end; a run cut off by its timeout leaves them in its folder.
tar -C /tmp -cJf "$OUT/cores-results.tar.xz" $(cd /tmp && ls -d phub16-results.* 2>/dev/null) 2>/dev/null
ls -la "$OUT"
