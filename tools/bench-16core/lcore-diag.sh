#!/usr/bin/env bash
# Why a kernel-UDP dataplane does not scale with lcores on the 16-core
# machine (BENCHMARKS.md, "On 16 cores"): W=8, L=8, ResNet-50, the bundle's
# build against its old/bin (bundle.sh OLD_BINS), and the new build with
# --no-pin and with --spin-us 0. For each, 5 s into the run: every thread of
# the dataplane process (name, CPU affinity, CPU ticks, CPU last run on)
# twice 1 s apart, `ss -uanm` (socket queues and drops), the dataplane's
# /v1/stats, and the kernel's UDP counters before and after. Needs the
# bundle unpacked (run.sh does it: STEPS=none).
#
#   OUT=$OUT tools/bench-16core/lcore-diag.sh     (the device tool, carry [".bench16"])
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:?set OUT to a folder for the results}
ROOT=${ROOT:-/opt/phub16}
mkdir -p "$OUT"
[[ -n "${SKIP_SETUP:-}" ]] || OUT="$OUT/setup" STEPS=none tools/bench-16core/run.sh >/dev/null 2>&1
rm -rf "$OUT/setup"
D=$(mktemp -d /tmp/phub-lcore-diag.XXXXXX)

snap() { # pid label
  for t in /proc/"$1"/task/*; do
    local id; id=$(basename "$t")
    echo "$2 $id $(cat "$t/comm") aff=$(taskset -p "$id" 2>/dev/null | awk '{print $NF}') ticks=$(awk '{print $14+$15}' "$t/stat") last_cpu=$(awk '{print $39}' "$t/stat")"
  done
}

one() { # label bindir rounds phub-bench-args...
  local l=$1 b=$2 rounds=$3; shift 3
  grep '^Udp:' /proc/net/snmp >"$D/$l.snmp"
  PATH="$b:$PATH" PHUB_BIN_DIR="$b" timeout 45 "$b/phub-bench" run --local --model resnet50 --workers 8 \
    --rounds "$rounds" --warmup 1 --no-ceiling --quiet "$@" >"$D/$l.log" 2>&1 &
  local bench=$!
  sleep 5
  local p; p=$(pgrep -f 'serve-dataplane|bin/phub-dataplane' | head -1)
  if [[ -n "$p" ]]; then
    tr '\0' ' ' <"/proc/$p/cmdline" >"$D/$l.cmdline"
    snap "$p" t0 >"$D/$l.threads"
    ss -uanm >"$D/$l.ss0"
    local mg; mg=$(grep -o -- '--mgmt [^ ]*' "$D/$l.cmdline" | cut -d' ' -f2)
    curl -s --max-time 2 "http://$mg/v1/stats" >"$D/$l.stats0.json"
    sleep 1
    snap "$p" t1 >>"$D/$l.threads"
    ss -uanm >"$D/$l.ss1"
    curl -s --max-time 2 "http://$mg/v1/stats" >"$D/$l.stats1.json"
  else
    echo "no dataplane process found 5 s in" >"$D/$l.threads"
  fi
  wait "$bench"
  echo "rc=$?" >>"$D/$l.log"
  grep '^Udp:' /proc/net/snmp >>"$D/$l.snmp"
  echo "== $l: $(grep -A1 '^model' "$D/$l.log" | tail -1)"
  grep -E 'lcore|ctl' "$D/$l.threads" | awk '{print "   ", $0}' | head -40
}

lscpu >"$D/lscpu.txt"; cat /sys/fs/cgroup/cpu.max /sys/fs/cgroup/cpu/cpu.cfs_quota_us 2>/dev/null >"$D/cpu-quota.txt"
echo "machine: $(nproc) CPUs; numa: $(ls -d /sys/devices/system/node/node* 2>/dev/null | wc -l) nodes; cgroup: $(cat /proc/self/cgroup)"
one new-l8 "$ROOT/bin" 40 --lcores ${L:-8}
one old-l8 "$ROOT/old/bin" 120 --lcores ${L:-8}
one new-l8-nopin "$ROOT/bin" 40 --lcores ${L:-8} --no-pin
one new-l8-spin0 "$ROOT/bin" 40 --lcores ${L:-8} --dataplane-arg=--spin-us=0
tar -C "$D" -cJf "$OUT/lcore-diag.tar.xz" .
