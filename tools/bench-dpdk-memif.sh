#!/usr/bin/env bash
# The DPDK dataplane alone over memif (BENCHMARKS.md, "DPDK dataplane alone,
# over memif"). For each chunk size and run, three steps, one after the
# other, with the same generator and the same frames:
#
#  1. phub-dataplane --backend dpdk --lcores 1 as memif server (its data lcore
#     on CPU 0, its main/management thread on CPU 1), and the generator
#     (dataplane/examples/dpdk_memif_gen.rs) as memif client on CPU 1: it
#     installs the job through the management API, sends W = 8 workers'
#     pushes round after round, and reads Mpps, GB/s and busy/idle polls
#     from the dataplane's /v1/stats over the timed window;
#  2. the engine's kernel-only figure, in the generator process on CPU 1
#     right after step 1's I/O phase (same pushes, from memory);
#  3. dpdk-testpmd --forward-mode=io as memif server on the same device
#     settings (forwarding lcore on CPU 0), fed by the same generator: the
#     packet I/O ceiling (the generator also prints a kernel-only figure
#     there, not used in the table).
#
# The three spinning threads (the dataplane's data lcore, testpmd's
# forwarding lcore, the generator) run under `chrt -f 10` (RT= to turn it
# off): on this 2-vCPU VM other jobs would otherwise time-slice with them.
# Every process starts as an ordinary one and only those threads are made
# real-time once they are up (the servers' rte-worker-1 with chrt -p, the
# generator by itself once its first round has gone out): started whole
# under chrt, EAL start-up on 2 CPUs stalled for minutes (threads created
# on a CPU where a same-priority FIFO thread spins never run). The
# generator yields its CPU whenever the memif ring is full.
#
# DEVICE=ring swaps memif for a port made of rings: phub-dataplane
# --ring-port, the generator attached to its rings as a DPDK secondary
# process (pointers pass, no copies; the nearest thing here to a NIC that
# DMAs into mbufs), and hands each result back on the port's completion
# ring so the dataplane's lcore frees it, as a NIC's TX completions would
# (COMPLETIONS=0: the generator frees them), and sends each template mbuf
# itself, references reserved in advance, pacing by results, so it writes
# no mbuf cache line per push, as a NIC writes only frames and descriptors
# (DIRECT=0: an indirect mbuf per push). Over the ring the kernel-only
# runs on the data lcore's own CPU (the dataplane runs with --idle-backoff,
# so its idle lcore sleeps then; saturated in the window, it never backs
# off there): both sides of the ratio on one CPU. (The lcore busy-time
# estimate assumes a spinning lcore, so it shows n/a there.) That needs
# hugepages: the script mounts hugetlbfs on
# /dev/hugepages if nothing is mounted, raises vm.nr_hugepages to HUGEPAGES
# (512 x 2 MiB) if lower, and puts both back on exit. testpmd cannot attach
# to those rings, so step 3 is skipped (a ring moves 600+ Mpps of pointers
# in testpmd's io mode: no ceiling at these rates).
#
#   tools/bench-dpdk-memif.sh                      # 8 KiB and 1 KiB, 3 runs each
#   DEVICE=ring tools/bench-dpdk-memif.sh          # the same over a ring port
#   DEVICE=ring RUNS=3 PAIRS=40 SECS=0.25 CHUNKS=8192 tools/bench-dpdk-memif.sh   # the steadiest ratio
#   DEVICE=ring CHECKSUMS=1 tools/bench-dpdk-memif.sh   # pushes with UDP checksums (verified in software)
#   DEVICE=ring NIC_CKSUM=1 tools/bench-dpdk-memif.sh   # results' checksums left to the port, as a NIC's offload
#   RUNS=1 CHUNKS=8192 SECS=2 tools/bench-dpdk-memif.sh
#   LCORE_CPU=2 MAIN_CPU=3 GEN_CPU=4 NO_BUILD=1 tools/bench-dpdk-memif.sh   # on more CPUs
#
# The CPUs default to this 2-vCPU VM's: data lcore on 0, main lcore and
# generator on 1. GEN, DP and COMMIT override the binaries and the commit shown.
#
# Needs root (chrt, /run), 2 CPUs, DPDK 22.11 with dpdk-testpmd (tools/setup.sh).
# Cleans up its processes, the socket, /var/run/dpdk/<prefix> and (ring)
# the dataplane's hugepage files on exit.
set -euo pipefail
cd "$(dirname "$0")/.."

RUNS=${RUNS:-3}
SECS=${SECS:-3}
# Timed windows per run, each followed by a kernel-only run of SECS (the
# ratio is the median over windows, each to the kernel-only runs beside it).
PAIRS=${PAIRS:-1}
SLOTS=${SLOTS:-512}
CHUNKS=${CHUNKS:-"8192 1024"}
RT=${RT-10}
DEVICE=${DEVICE:-memif}
HUGEPAGES=${HUGEPAGES:-512}
RING=phubbench
COMPLETIONS=${COMPLETIONS:-1}
DIRECT=${DIRECT:-1}
# CHECKSUMS=1: pushes carry UDP checksums, which the dataplane verifies in
# software (neither a ring port nor memif checks them): what that costs.
CHECKSUMS=${CHECKSUMS:-0}
# NIC_CKSUM=1 (ring): the ring port is a NIC with TX checksum offload, which
# fills in results' checksums: the dataplane copies results without summing
# them (--ring-port-tx-checksums; the generator does not check them).
NIC_CKSUM=${NIC_CKSUM:-0}
SOCK=${SOCK:-/run/phub-bench-memif.sock}
MGMT=${MGMT:-127.0.0.1:7877}
DP_PREFIX=phub-memif-dp
TP_PREFIX=phub-memif-tp
GEN_PREFIX=phub-memif-gen
LOGS=$(mktemp -d /tmp/phub-memif-bench.XXXXXX)
GEN=${GEN:-target/release/examples/dpdk_memif_gen}
DP=${DP:-target/release/phub-dataplane}
# CPUs: the servers' data lcore, their main (management) lcore, the generator.
LCORE_CPU=${LCORE_CPU:-0}
MAIN_CPU=${MAIN_CPU:-1}
GEN_CPU=${GEN_CPU:-1}

if [ "${NO_BUILD:-}" = "" ]; then
  cargo build --release -q -p phub-dataplane --example dpdk_memif_gen
  cargo build --release -q -p phub --bin phub-dataplane
fi
case "$DEVICE" in
  memif) command -v dpdk-testpmd >/dev/null || { echo "dpdk-testpmd not found (apt-get install dpdk-dev)" >&2; exit 1; } ;;
  ring) ;;
  *) echo "DEVICE=$DEVICE: expected memif or ring" >&2; exit 2 ;;
esac

PEER_PID=""
FIFO=""
cleanup() {
  if [ -n "$FIFO" ]; then
    exec 3>&-
    rm -f "$FIFO"
    FIFO=""
  fi
  if [ -n "$PEER_PID" ] && kill -0 "$PEER_PID" 2>/dev/null; then
    kill -INT "$PEER_PID" 2>/dev/null || true
    for _ in $(seq 50); do kill -0 "$PEER_PID" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "$PEER_PID" 2>/dev/null || true
    wait "$PEER_PID" 2>/dev/null || true
  fi
  PEER_PID=""
  rm -f "$SOCK"
  rm -rf "/var/run/dpdk/$DP_PREFIX" "/var/run/dpdk/$TP_PREFIX" "/var/run/dpdk/$GEN_PREFIX"
  # The dataplane removes its hugepage files when it exits; not when it
  # had to be killed.
  [ "$DEVICE" != ring ] || rm -f /dev/hugepages/"$DP_PREFIX"map_*
}
OLD_HUGEPAGES=""
MOUNTED_HUGE=""
restore_hugepages() {
  [ -z "$OLD_HUGEPAGES" ] || echo "$OLD_HUGEPAGES" >/proc/sys/vm/nr_hugepages
  [ -z "$MOUNTED_HUGE" ] || umount /dev/hugepages
}
trap 'cleanup; restore_hugepages' EXIT
trap 'exit 130' INT TERM

# memif buffer: the next power of two holding a whole frame (128 B of headers).
bsize() { local b=2048; while [ "$b" -lt $(($1 + 128)) ]; do b=$((b * 2)); done; echo $b; }
# `key=value` from a RESULT line.
field() { tr ' ' '\n' <<<"$1" | sed -n "s/^$2=//p"; }
load() { cut -d' ' -f1 /proc/loadavg; }
# Makes a server's data lcore thread (EAL's rte-worker-1) real-time.
rt_lcore() { # pid
  [ -n "$RT" ] || return 0
  local f
  for f in /proc/"$1"/task/*/comm; do
    if [ "$(cat "$f" 2>/dev/null)" = rte-worker-1 ]; then
      chrt -f -p "$RT" "$(basename "$(dirname "$f")")"
      return 0
    fi
  done
  echo "no rte-worker-1 thread in process $1" >&2
  exit 1
}

generator() { # peer chunk log
  local attach=(--socket "$SOCK" --file-prefix "$GEN_PREFIX")
  [ "$DEVICE" != ring ] || attach=(--ring "$RING" --file-prefix "$DP_PREFIX")
  [ "$DEVICE" != ring ] || [ "$COMPLETIONS" = 0 ] || attach+=(--ring-completions)
  [ "$DEVICE" != ring ] || [ "$DIRECT" = 0 ] || attach+=(--ring-direct)
  [ "$CHECKSUMS" = 0 ] || attach+=(--udp-checksums)
  [ "$DEVICE" != ring ] || attach+=(--kernel-cpu "$LCORE_CPU")
  taskset -c "$GEN_CPU" "$GEN" --peer "$1" --chunk "$2" --seconds "$SECS" --kernel-seconds "$SECS" --pairs "$PAIRS" --rt-priority "${RT:-0}" \
    --slots "$SLOTS" --mgmt "$MGMT" --cpu "$GEN_CPU" "${attach[@]}" >"$3" 2>&1 \
    || { echo "generator ($1, chunk $2) failed; its log, $3:" >&2; tail -20 "$3" >&2; exit 1; }
}

dataplane_step() { # chunk bsize log
  local dev=(--eal "--no-pci --no-huge -m 1024 --no-shconf --no-telemetry --file-prefix $DP_PREFIX --lcores 0@$MAIN_CPU,1@$LCORE_CPU --vdev=net_memif0,role=server,socket=$SOCK,socket-abstract=no,bsize=$2")
  [ "$DEVICE" != ring ] || dev=(--ring-port "$RING" --idle-backoff --eal "--no-pci --no-telemetry --file-prefix $DP_PREFIX --lcores 0@$MAIN_CPU,1@$LCORE_CPU")
  [ "$DEVICE" != ring ] || [ "$NIC_CKSUM" = 0 ] || dev+=(--ring-port-tx-checksums)
  rm -f "$SOCK"
  "$DP" --backend dpdk --lcores 1 --host 10.79.0.1 --base-port 7900 --mgmt "$MGMT" \
    --memory-budget 256MiB "${dev[@]}" >"$3.dp" 2>&1 &
  PEER_PID=$!
  for _ in $(seq 100); do
    curl -sf "http://$MGMT/v1/info" >/dev/null 2>&1 && break
    kill -0 "$PEER_PID" 2>/dev/null || { echo "phub-dataplane exited; its log:" >&2; cat "$3.dp" >&2; exit 1; }
    sleep 0.1
  done
  rt_lcore "$PEER_PID"
  generator dataplane "$1" "$3"
  cleanup
}

testpmd_step() { # chunk bsize log
  local vdev="--vdev=net_memif0,role=server,socket=$SOCK,socket-abstract=no,bsize=$2"
  rm -f "$SOCK"
  FIFO=$(mktemp -u /tmp/phub-memif-fifo.XXXXXX)
  mkfifo "$FIFO"
  # testpmd exits when its stdin closes (fd 3 below).
  dpdk-testpmd --no-huge -m 1024 --no-pci --no-shconf --no-telemetry --file-prefix "$TP_PREFIX" \
    --lcores=0@$MAIN_CPU,1@$LCORE_CPU "$vdev" -- --forward-mode=io --auto-start --rxd=1024 --txd=1024 \
    --mbuf-size=16512 --total-num-mbufs=8192 <"$FIFO" >"$3.tp" 2>&1 &
  PEER_PID=$!
  exec 3>"$FIFO"
  # The memif device must be started before the client connects: a client
  # that arrives earlier is refused ("ID 0 not found") and does not retry.
  for _ in $(seq 200); do
    grep -q "Press enter to exit" "$3.tp" && break
    kill -0 "$PEER_PID" 2>/dev/null || { echo "dpdk-testpmd exited; its log:" >&2; cat "$3.tp" >&2; exit 1; }
    sleep 0.1
  done
  rt_lcore "$PEER_PID"
  generator testpmd "$1" "$3"
  exec 3>&-
  for _ in $(seq 50); do kill -0 "$PEER_PID" 2>/dev/null || break; sleep 0.1; done
  cleanup
}

if [ "$DEVICE" = ring ]; then
  if ! grep -q ' /dev/hugepages hugetlbfs ' /proc/mounts; then
    mkdir -p /dev/hugepages && mount -t hugetlbfs nodev /dev/hugepages && MOUNTED_HUGE=1
  fi
  now=$(cat /proc/sys/vm/nr_hugepages)
  if [ "$now" -lt "$HUGEPAGES" ]; then
    OLD_HUGEPAGES=$now
    echo "$HUGEPAGES" >/proc/sys/vm/nr_hugepages
    [ "$(cat /proc/sys/vm/nr_hugepages)" -ge "$HUGEPAGES" ] || { echo "could not get $HUGEPAGES hugepages" >&2; exit 1; }
  fi
fi
echo "device: $DEVICE$([ "$DEVICE" = ring ] && [ "$COMPLETIONS" != 0 ] && echo ', results freed by the dataplane (completion ring)')$([ "$DEVICE" = ring ] && [ "$DIRECT" != 0 ] && echo ', pushes are the template mbufs')$([ "$CHECKSUMS" != 0 ] && echo ', pushes carry UDP checksums (verified in software)')$([ "$DEVICE" = ring ] && [ "$NIC_CKSUM" != 0 ] && echo ", results' checksums left to the port (--ring-port-tx-checksums)")"
echo "machine: $(nproc) CPUs, $(lscpu | sed -n 's/^Model name: *//p'), commit ${COMMIT:-$(git rev-parse --short HEAD)$(git diff --quiet -- dataplane ffi || echo ' + uncommitted changes')}, logs in $LOGS"
echo "W=8, $SLOTS slots, ${SECS} s windows, ${RT:+spinning threads SCHED_FIFO $RT}$([ -n "$RT" ] || echo "no chrt"); GB/s = gradient bytes (chunk payload) per second"
rows=()
for chunk in $CHUNKS; do
  b=$(bsize "$chunk")
  for run in $(seq "$RUNS"); do
    l0=$(load)
    dataplane_step "$chunk" "$b" "$LOGS/dp-$chunk-$run.log"
    d=$(grep '^RESULT' "$LOGS/dp-$chunk-$run.log")
    if [ "$DEVICE" = memif ]; then
      testpmd_step "$chunk" "$b" "$LOGS/tp-$chunk-$run.log"
      t=$(grep '^RESULT' "$LOGS/tp-$chunk-$run.log")
    else
      t="mpps=n/a gbs=n/a"
    fi
    dg=$(field "$d" gbs)
    tg=$(field "$t" gbs)
    rows+=("$(printf '| %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s |' \
      "$chunk" "$run" "$(field "$d" mpps)" "$dg" "$(field "$d" gen_mpps)" "$(field "$d" kernel_gbs)" \
      "$(field "$d" ratio)" "$([ "$DEVICE" = ring ] && echo "n/a" || field "$d" busy)" "$(field "$t" mpps)" "$tg" \
      "$(awk -v a="$dg" -v b="$tg" 'BEGIN { if (b + 0 > 0) printf "%.2f", a / b; else printf "n/a" }')") load $l0")
    echo "${rows[-1]}"
  done
done
echo
echo "| chunk B | run | dataplane Mpps | dataplane GB/s | results back Mpps | kernel-only GB/s | dataplane / kernel-only | lcore busy time (est.) | testpmd Mpps | testpmd GB/s | dataplane / testpmd |"
echo "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"
for r in "${rows[@]}"; do echo "${r% load *}"; done
