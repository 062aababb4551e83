#!/usr/bin/env bash
# The benchmarks that need more than this VM's 2 vCPUs, run in one go on a
# lent machine with 16 cores and neither Rust nor DPDK installed (BENCHMARKS.md,
# "On 16 cores"). Unpacks .bench16/bundle.tar.xz (tools/bench-16core/bundle.sh)
# to /opt/phub16, installs only the shared libraries the machine lacks, and
# runs, each with its CPUs of its own where it pins:
#
#   1. memif: the DPDK dataplane alone, 8 KiB and 1 KiB chunks
#      (tools/bench-dpdk-memif.sh: data lcore on CPU 2, generator on CPU 4);
#      "ring" (not in the default steps): the same over a ring port
#      (DEVICE=ring: generator as DPDK secondary process, hugepages);
#   2. phub-bench on the virtual rack (DPDK af_packet over veth), ResNet-50,
#      W=2 on 1 and 2 lcores and W=4 on 4, lcores spinning, efficiency against the same run's veth ceiling;
#   3. phub-bench on loopback UDP, ResNet-50, W=1 and W=2, and sweeps of lcores
#      (W=8) and of workers (4 lcores);
#   4. python/bench/bench_exchange.py: phub comm hook against gloo, W=2,
#      1 and 4 dataplane lcores
#      (only where python3 has torch).
#
# Results go to $OUT (or OUT=DIR): summary.txt and results.tar.xz (the JSON
# files and logs). STEPS="memif dpdk udp torch" picks steps; "shm" and
# "torch-shm" run the shared-memory transport (phub-bench --shm;
# bench_exchange.py --shm at W=2 on 1 and 4 lcores and W=4 on 4); "lcores"
# sweeps the dataplane's lcores (1, 2, 4, 8) on the ResNet-50 exchange, W=8
# over loopback UDP and over shared memory, W=4 over DPDK af_packet;
# "lcores-ab" runs the UDP W=8 sweep AB_RUNS times (default 3) with this
# build and with the bundle's old/bin (OLD_BINS at bundle time), alternating,
# to tell a change of machine from a change of code; "lcores-dpdk" the
# DPDK af_packet sweep alone (DPDK_RUNS times, default 1); "lcores-var" runs the UDP W=8 sweep over
# lcores VAR_LCORES (default 4,8) once per variant of VARIANTS (extra
# phub-bench arguments, variants separated by ";", e.g. "--window 252;
# --dataplane-arg=--spin-us=0"), with this build and with old/bin,
# alternating; "bisect" runs the UDP W=8 sweep over lcores
# BISECT_LCORES (default 1,8) once with each build the bundle packed under
# bisect/ (bundle.sh BISECT_DIRS), then with this one; "sparse" runs
# issue 32's table figures (BENCHMARKS.md, "One lcore's BSP rounds
# alone"): end to end W = 4, D = 16, K = 4096, Zipf 1.05 against the TCP
# row server, BSP and async on 2 lcores (SPARSE_RUNS times each, default
# 2) and BSP on 4, the pull against a dense pull, the row store alone at
# 10^8 rows on one lcore, and engine/examples/bsp_round_bench (where the
# bundle has it); "sparse-ok" the cost O(K), a step on 10^5 and on 10^8
# stored rows (--prefill), once each.
#
#   OUT=/tmp/o COMMIT=$(git rev-parse --short HEAD) tools/bench-16core/run.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:?set OUT to a folder for the results}
STEPS=${STEPS:-"memif dpdk udp torch"}
ROOT=/opt/phub16
R=$(mktemp -d /tmp/phub16-results.XXXXXX)
SUM="$OUT/summary.txt"
mkdir -p "$OUT"
say() { echo "$*" | tee -a "$SUM"; }
t0=$(date +%s)
stamp() { say "== [$(($(date +%s) - t0)) s] $*"; }

stamp "setup"
rm -rf "$ROOT" && mkdir -p "$ROOT" && tar -C "$ROOT" -xJf .bench16/bundle.tar.xz || { say "no bundle"; exit 1; }
# Libraries: only those the machine lacks go to /usr/local/lib.
# (The cache is read once: `ldconfig -p | grep -q` fails under pipefail
# when grep leaves early.)
ldconfig -p >"$R/ldcache"
for l in "$ROOT"/lib/*; do
  n=$(basename "$l")
  grep -q "^[[:space:]]$n " "$R/ldcache" || cp "$l" /usr/local/lib/
done
ldconfig
ldconfig -p >"$R/ldcache"
# DPDK loads its drivers from the folder built into librte_eal (only files
# named *.so or *.so.23.0 there). Each entry is a link to the very file the
# other libraries load (as Debian's are): a second copy of a bus driver
# loaded from another path registers the bus twice.
PMDDIR=/usr/lib/x86_64-linux-gnu/dpdk/pmds-23.0
mkdir -p "$PMDDIR"
for f in "$ROOT"/pmds/*; do
  n=$(basename "$f")
  t=$(awk -v n="$n" '$1 == n { print $NF; exit }' "$R/ldcache")
  [ -n "$t" ] || { cp "$f" /usr/local/lib/; t=/usr/local/lib/$n; }
  [ -e "$PMDDIR/${n%.23}" ] || ln -s "$t" "$PMDDIR/${n%.23}"
done
ldconfig
export PATH="$ROOT/bin:$PATH" PHUB_BIN_DIR="$ROOT/bin"
say "machine: $(nproc) CPUs, $(lscpu | sed -n 's/^Model name: *//p'), $(free -g | awk '/^Mem/{print $2}') GiB, kernel $(uname -r), commit ${COMMIT:-?}"
say "libraries installed from the bundle: $(ls /usr/local/lib | grep '\.so' | tr '\n' ' ')"
for b in phub-dataplane phub-bench dpdk-testpmd ip; do
  ldd "$ROOT/bin/$b" | grep -q "not found" && say "MISSING for $b: $(ldd "$ROOT/bin/$b" | grep 'not found' | tr '\n' ' ')"
done
command -v curl chrt taskset stdbuf >/dev/null || say "missing one of curl chrt taskset stdbuf"
say "drivers: $(ls -l "$PMDDIR" | awk '{print $9 $10 $11}' | tr '\n' ' ')"
if [ -n "${DIAG:-}" ]; then
  timeout 4 dpdk-testpmd --no-huge -m 512 --no-pci --no-shconf --file-prefix phub16-diag --log-level='*:debug' \
    --vdev=net_memif0,role=server,socket=/run/phub16-diag.sock,socket-abstract=no -- --stats-period 1 </dev/null 2>&1 \
    | grep -v "log level changed" | grep -iE "memif|vdev|probe|fail|error|cannot|unable" | head -40 | tee -a "$SUM"
  rm -f /run/phub16-diag.sock
fi

# memif, and the ring port with paired windows (the figures of record's
# method, BENCHMARKS.md); RT empty: the lent machine refuses SCHED_FIFO
# (chrt: Operation not permitted).
for dev in memif ring; do
  [[ " $STEPS " == *" $dev "* ]] || continue
  stamp "$dev"
  case $dev in
    memif) secs=3 pairs=1 ;;
    ring) secs=0.25 pairs=${RING_PAIRS:-40} ;;
  esac
  RT=${RT-} NO_BUILD=1 GEN="$ROOT/bin/dpdk_memif_gen" DP="$ROOT/bin/phub-dataplane" COMMIT="${COMMIT:-?}" \
    DEVICE=$dev LCORE_CPU=2 MAIN_CPU=3 GEN_CPU=4 RUNS=${MEMIF_RUNS:-2} SECS=$secs PAIRS=$pairs \
    timeout 200 tools/bench-dpdk-memif.sh >"$R/$dev.log" 2>&1
  say "$dev rc=$?"; tail -8 "$R/$dev.log" | tee -a "$SUM"
done

bench() { # name args...
  local n=$1; shift
  timeout 120 phub-bench run --quiet --json "$R/$n.json" "$@" >"$R/$n.log" 2>&1
  local rc=$?
  say "-- $n (rc=$rc): phub-bench run $*"
  tail -n 14 "$R/$n.log" | tee -a "$SUM"
}

if [[ " $STEPS " == *" dpdk "* ]]; then
  stamp "dpdk end to end"
  bench dpdk-w2-l1 --local --backend dpdk --busy-poll --model resnet50 --workers 2 --rounds 10 --warmup 2
  bench dpdk-w2-l2 --local --backend dpdk --busy-poll --model resnet50 --workers 2 --rounds 10 --warmup 2 --lcores 2
  bench dpdk-w4-l4 --local --backend dpdk --busy-poll --model resnet50 --workers 4 --rounds 8 --warmup 2 --lcores 4
fi

if [[ " $STEPS " == *" udp "* ]]; then
  stamp "udp loopback"
  bench udp-w1 --local --model resnet50 --workers 1 --rounds 10 --warmup 2
  bench udp-w2 --local --model resnet50 --workers 2 --rounds 10 --warmup 2
  bench udp-w8-lcores --local --model resnet50 --workers 8 --rounds 6 --warmup 1 --sweep lcores=1,2,4,8 \
    --no-ceiling --plot "$R/udp-w8-lcores.svg"
  bench udp-l4-workers --local --model resnet50 --lcores 4 --rounds 6 --warmup 1 --sweep workers=1,2,4,8 \
    --no-ceiling --plot "$R/udp-l4-workers.svg"
fi

if [[ " $STEPS " == *" lcores "* ]]; then
  stamp "lcore scaling, ResNet-50"
  bench lcores-udp-w8 --local --model resnet50 --workers 8 --rounds 6 --warmup 1 --sweep lcores=1,2,4,8 \
    --no-ceiling --plot "$R/lcores-udp-w8.svg"
  bench lcores-shm-w8 --local --shm --model resnet50 --workers 8 --rounds 6 --warmup 1 --sweep lcores=1,2,4,8 \
    --no-ceiling --plot "$R/lcores-shm-w8.svg"
  bench lcores-dpdk-w4 --local --backend dpdk --busy-poll --model resnet50 --workers 4 --rounds 6 --warmup 1 \
    --sweep lcores=1,2,4,8 --no-ceiling --plot "$R/lcores-dpdk-w4.svg"
fi

if [[ " $STEPS " == *" lcores-ab "* ]]; then
  old=$(cat "$ROOT/old/COMMIT" 2>/dev/null || echo none)
  stamp "lcore scaling, UDP W=8: ${COMMIT:-?} against $old, alternating"
  for i in $(seq 1 "${AB_RUNS:-3}"); do
    bench "lcores-udp-w8-new-$i" --local --model resnet50 --workers 8 --rounds 6 --warmup 1 --sweep lcores=1,2,4,8 \
      --no-ceiling
    if [[ -x "$ROOT/old/bin/phub-bench" ]]; then
      PATH="$ROOT/old/bin:$PATH" PHUB_BIN_DIR="$ROOT/old/bin" \
        bench "lcores-udp-w8-old-$i" --local --model resnet50 --workers 8 --rounds 6 --warmup 1 \
        --sweep lcores=1,2,4,8 --no-ceiling
    fi
    say "steal ticks so far: $(awk '/^cpu /{print $9}' /proc/stat)"
  done
fi

if [[ " $STEPS " == *" lcores-var "* ]]; then
  stamp "lcore scaling, UDP W=8, variants: ${VARIANTS:-}"
  IFS=';' read -r -a vars <<<"${VARIANTS:-}"
  i=0
  for v in "${vars[@]}"; do
    i=$((i + 1))
    # shellcheck disable=SC2086 # a variant is a list of arguments
    bench "var$i-new" --local --model resnet50 --workers 8 --rounds 6 --warmup 1 \
      --sweep "lcores=${VAR_LCORES:-4,8}" --no-ceiling $v
    if [[ -x "$ROOT/old/bin/phub-bench" ]]; then
      # shellcheck disable=SC2086
      PATH="$ROOT/old/bin:$PATH" PHUB_BIN_DIR="$ROOT/old/bin" \
        bench "var$i-old" --local --model resnet50 --workers 8 --rounds 6 --warmup 1 \
        --sweep "lcores=${VAR_LCORES:-4,8}" --no-ceiling $v
    fi
  done
fi

if [[ " $STEPS " == *" bisect "* ]]; then
  stamp "bisect: UDP W=8, lcores ${BISECT_LCORES:-1,8}, each packed build"
  for d in "$ROOT"/bisect/*/ "$ROOT/bin/"; do
    n=$(basename "$d"); [[ "$d" == "$ROOT/bin/" ]] && n="this-${COMMIT:-?}"
    PATH="$d:$PATH" PHUB_BIN_DIR="$d" \
      bench "bisect-$n" --local --model resnet50 --workers 8 --rounds 6 --warmup 1 \
      --sweep "lcores=${BISECT_LCORES:-1,8}" --no-ceiling
  done
fi

if [[ " $STEPS " == *" lcores-dpdk "* ]]; then
  stamp "lcore scaling, DPDK af_packet W=4, ${DPDK_RUNS:-1} run(s)"
  for i in $(seq 1 "${DPDK_RUNS:-1}"); do
    bench "lcores-dpdk-w4-$i" --local --backend dpdk --busy-poll --model resnet50 --workers 4 --rounds 6 --warmup 1 \
      --sweep lcores=1,2,4,8 --no-ceiling
  done
fi

sparse() { # name args...
  local n=$1; shift
  timeout 240 phub-bench sparse --json "$R/$n.json" "$@" >"$R/$n.log" 2>&1
  local rc=$?
  say "-- $n (rc=$rc): phub-bench sparse $*"
  tail -n 8 "$R/$n.log" | tee -a "$SUM"
}

if [[ " $STEPS " == *" sparse "* ]]; then
  stamp "sparse tables (issue 32)"
  e2e="--local --workers 4 --rows 1000000 --dim 16 --batch 4096 --zipf 1.05"
  for i in $(seq 1 "${SPARSE_RUNS:-2}"); do
    for mode in bsp async; do
      sparse "sparse-$mode-l2-$i" $e2e --lcores 2 --steps 1500 --consistency $mode --baseline tcp-ps
    done
  done
  sparse sparse-bsp-l4 $e2e --lcores 4 --steps 1500 --consistency bsp --baseline tcp-ps
  sparse sparse-pull $e2e --lcores 2 --steps 3000 --pull-only --dense-pull
  sparse sparse-engine-1e8 --engine-only --lcores 1 --rows 100000000 --dim 16 --batch 4096
  if [ -x "$ROOT/bin/bsp_round_bench" ]; then
    timeout 120 "$ROOT/bin/bsp_round_bench" 300 >"$R/bsp_round_bench.log" 2>&1
    say "-- bsp_round_bench 300 (rc=$?)"; tail -n 7 "$R/bsp_round_bench.log" | tee -a "$SUM"
  fi
fi

if [[ " $STEPS " == *" sparse-ok "* ]]; then
  stamp "sparse tables, cost O(K)"
  for rows in 100000 100000000; do
    sparse "sparse-ok-$rows" --local --workers 4 --lcores 2 --rows $rows --dim 16 --batch 4096 --zipf 1.05 \
      --steps 300 --prefill
  done
fi

if [[ " $STEPS " == *" shm "* ]]; then
  stamp "udp loopback, shared memory"
  bench shm-w2-l1 --local --shm --model resnet50 --workers 2 --rounds 10 --warmup 2 --no-ceiling
  bench shm-w2-l4 --local --shm --model resnet50 --workers 2 --rounds 10 --warmup 2 --lcores 4 --no-ceiling
  bench shm-w8-l4 --local --shm --model resnet50 --workers 8 --rounds 6 --warmup 1 --lcores 4 --no-ceiling
  bench shm-w2-l4-handles --local --shm --model resnet50 --workers 2 --rounds 10 --warmup 2 --lcores 4 \
    --api handles --no-ceiling
fi

if [[ " $STEPS " == *" torch-shm "* ]] && python3 -c 'import torch' 2>/dev/null; then
  stamp "torch, shared memory"
  export PYTHONPATH="$ROOT/py${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
  for wl in ${TORCH_SHM_CASES:-2:1 2:4 4:4}; do  # W:L
    w=${wl%:*} l=${wl#*:}
    timeout 150 python3 python/bench/bench_exchange.py --workers "$w" --trials 6 --lcores "$l" --shm \
      >"$R/torch-shm-w$w-l$l.log" 2>&1
    say "torch --shm --workers $w --lcores $l rc=$?"; tail -n 12 "$R/torch-shm-w$w-l$l.log" | tee -a "$SUM"
  done
fi

if [[ " $STEPS " == *" torch "* ]]; then
  stamp "torch"
  if python3 -c 'import torch' 2>/dev/null; then
    export PYTHONPATH="$ROOT/py${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
    for l in 1 4; do
      timeout 150 python3 python/bench/bench_exchange.py --workers 2 --trials 6 --lcores $l >"$R/torch-w2-l$l.log" 2>&1
      say "torch --lcores $l rc=$?"; tail -n 12 "$R/torch-w2-l$l.log" | tee -a "$SUM"
    done
  else
    say "python3 has no torch: skipped"
  fi
fi
stamp "done"
tar -C "$R" -cJf "$OUT/results.tar.xz" .
