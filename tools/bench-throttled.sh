#!/usr/bin/env bash
# The worker's loss response under a throttled appliance: phub-dataplane
# (kernel UDP, 1 lcore) in a cgroup limited to QUOTA of one CPU, and
# `phub-bench run` against it, alternating runs with the worker's congestion
# control off (PHUB_WORKER_CONGESTION=off) and on, same binaries, same
# minutes. Prints one line per run: median, p99, retransmissions, window
# cuts. Needs root (cgroup v1 `cpu` at /sys/fs/cgroup/cpu, or cgroup v2)
# and the release binaries (make release-bins; cargo build --release -p
# phub-tools).
#
#   QUOTA=0.5 RUNS=3 MODEL=resnet50 WORKERS=2 ROUNDS=20 tools/bench-throttled.sh
#   DP_ARGS="--socket-buffer 262144" ...   (extra phub-dataplane flags: a small
#                                           receive buffer overflows sooner)
set -euo pipefail
cd "$(dirname "$0")/.."
QUOTA=${QUOTA:-0.5}
RUNS=${RUNS:-3}
MODEL=${MODEL:-resnet50}
WORKERS=${WORKERS:-2}
ROUNDS=${ROUNDS:-20}
BIN=${BIN:-target/release}
dir=$(mktemp -d /tmp/phub-throttled-XXXXXX)
export PHUB_RUNTIME_DIR=$dir
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
mgmt=$(free_port); ctl=$(free_port)
period=100000
quota=$(python3 -c "print(int($QUOTA * $period))")
cg=""
cleanup() {
    [ -n "${cpid:-}" ] && kill "$cpid" 2>/dev/null || true
    [ -n "${dpid:-}" ] && kill "$dpid" 2>/dev/null || true
    wait 2>/dev/null || true
    [ -n "$cg" ] && rmdir "$cg" 2>/dev/null || true
    rm -rf "$dir"
}
trap cleanup EXIT INT TERM
"$BIN/phub-dataplane" --lcores 1 --no-pin --base-port 0 --mgmt "127.0.0.1:$mgmt" \
    --memory-budget 2GiB ${DP_ARGS:-} > "$dir/dataplane.log" 2>&1 &
dpid=$!
for _ in $(seq 100); do curl -sf "http://127.0.0.1:$mgmt/v1/info" > /dev/null && break; sleep 0.1; done
if [ -d /sys/fs/cgroup/cpu ] && [ -w /sys/fs/cgroup/cpu ]; then
    cg=/sys/fs/cgroup/cpu/phub-throttled-$$
    mkdir "$cg"
    echo $period > "$cg/cpu.cfs_period_us"
    echo "$quota" > "$cg/cpu.cfs_quota_us"
    for t in /proc/$dpid/task/*; do echo "${t##*/}" > "$cg/tasks"; done
else
    cg=/sys/fs/cgroup/phub-throttled-$$
    mkdir "$cg"
    echo "$quota $period" > "$cg/cpu.max"
    echo "$dpid" > "$cg/cgroup.procs"
fi
"$BIN/phub-control" --listen "127.0.0.1:$ctl" --dataplane "http://127.0.0.1:$mgmt" \
    --state "$dir/state.json" --reconcile-ms 500 > "$dir/control.log" 2>&1 &
cpid=$!
for _ in $(seq 100); do curl -sf "http://127.0.0.1:$ctl/v1/jobs" > /dev/null && break; sleep 0.1; done
export PHUB_OPERATOR_TOKEN=$(cat "$dir/state.json.operator-token")
echo "dataplane limited to $QUOTA CPU ($quota/$period us, $cg) ${DP_ARGS:-}; $MODEL W=$WORKERS, $ROUNDS rounds; $(date -u +%FT%TZ)"
grep -E '^cpu ' /proc/stat | awk '{print "steal at start: " $9}'
for run in $(seq "$RUNS"); do
    for mode in off on; do
        PHUB_WORKER_CONGESTION=$mode "$BIN/phub-bench" run --control "http://127.0.0.1:$ctl" \
            --model "$MODEL" --workers "$WORKERS" --rounds "$ROUNDS" --no-ceiling --quiet \
            --json "$dir/run.json" > /dev/null 2>&1 || { echo "run $run congestion=$mode failed"; continue; }
        python3 - "$dir/run.json" "$run" "$mode" <<'EOF'
import json, sys
j = json.load(open(sys.argv[1]))
p = j["points"][0] if "points" in j else j
print(f"run {sys.argv[2]} congestion={sys.argv[3]:<3} median {p['round_ms_median']:.1f} ms  p99 {p['round_ms_p99']:.1f} ms  "
      f"p99/median {p['round_ms_p99']/p['round_ms_median']:.2f}  retransmits {p['retransmits']}")
EOF
    done
done
grep -E '^cpu ' /proc/stat | awk '{print "steal at end: " $9}'
