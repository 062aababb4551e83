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
#   MODES="window=59 off on" ...            (what to alternate: off/on is the
#                                           congestion window; window=N a fixed
#                                           window, as workers chose before they
#                                           knew the appliance's buffer)
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
socket_full() {
    curl -sf "http://127.0.0.1:$mgmt/v1/stats" | python3 -c \
        'import json,sys; print(sum(l["drops"].get("socket_full", 0) for l in json.load(sys.stdin)["lcores"]))'
}
for run in $(seq "$RUNS"); do
    for mode in ${MODES:-off on}; do
        # off / on: the worker's congestion window (PHUB_WORKER_CONGESTION);
        # window=N: a fixed window of N chunks, congestion window off.
        case $mode in
            window=*) cong=off; win=(--window "${mode#window=}") ;;
            *) cong=$mode; win=() ;;
        esac
        before=$(socket_full)
        PHUB_WORKER_CONGESTION=$cong "$BIN/phub-bench" run --control "http://127.0.0.1:$ctl" \
            --model "$MODEL" --workers "$WORKERS" --rounds "$ROUNDS" --no-ceiling --quiet "${win[@]}" \
            --json "$dir/run.json" > /dev/null 2>&1 || { echo "run $run $mode failed"; continue; }
        full=$(( $(socket_full) - before ))
        python3 - "$dir/run.json" "$run" "$mode" "$full" <<'EOF'
import json, sys
j = json.load(open(sys.argv[1]))
p = j["points"][0] if "points" in j else j
print(f"run {sys.argv[2]} {sys.argv[3]:<10} window {p.get('window', '?'):>4}  median {p['round_ms_median']:.1f} ms  "
      f"p99 {p['round_ms_p99']:.1f} ms  p99/median {p['round_ms_p99']/p['round_ms_median']:.2f}  "
      f"retransmits {p['retransmits']}  socket_full {sys.argv[4]}")
EOF
    done
done
grep -E '^cpu ' /proc/stat | awk '{print "steal at end: " $9}'
