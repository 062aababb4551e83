#!/usr/bin/env bash
# make test-package-systemd (optional, not in `make test`): the package's
# units under a real systemd. Boots the Debian 12 root of test-package.sh
# (a copy of its cached tarball) with `systemd-nspawn --boot` in a private
# network namespace, installs the package there (its postinst enables both
# units, starts neither), starts phub-control and checks that
# phub-dataplane started first (Wants=/After=), admits a job over TLS with
# the installed phubctl and trains it with 2 workers inside, kills the
# dataplane with SIGKILL and sees systemd restart it and control reinstall
# the job, checks both daemons' lines in the journal, then reboots the
# container and sees both units start at boot, dataplane first. Leaves no
# container, mount or root behind. Needs root and systemd-nspawn (package
# systemd-container, installed when missing); about 40 s once the root is
# cached. The host needs no systemd of its own (--register=no
# --keep-unit: no machined, no scope).
#   PHUB_PKGTEST_NO_BUILD=1, PHUB_DEB_PROFILE=debug  as in test-package.sh
set -euo pipefail
cd "$(dirname "$0")/.."
[ "$(id -u)" -eq 0 ] || { echo "test-package-systemd: needs root (systemd-nspawn)" >&2; exit 1; }

t0=$(date +%s)
step() { echo "test-package-systemd [$(( $(date +%s) - t0 ))s]: $*"; }
fail() { echo "test-package-systemd: $*" >&2; exit 1; }

. packaging/pkgtest-common.sh
pkgtest_need mmdebstrap dpkg-dev systemd-container
pkgtest_deb
pkgtest_tarball

work=$(realpath target/pkgtest)
root="$work/nspawn-root"
machine="phub-pkgtest-$$"
nspawn_pid=
leader=
cleanup() {
    set +e
    if [ -n "$nspawn_pid" ] && kill -0 "$nspawn_pid" 2>/dev/null; then
        [ -n "$leader" ] && nsenter -t "$leader" -a systemctl poweroff >/dev/null 2>&1
        for _ in $(seq 40); do kill -0 "$nspawn_pid" 2>/dev/null || break; sleep 0.25; done
        # SIGTERM: nspawn asks the container's systemd to shut down.
        kill -0 "$nspawn_pid" 2>/dev/null && kill -TERM "$nspawn_pid"
        for _ in $(seq 40); do kill -0 "$nspawn_pid" 2>/dev/null || break; sleep 0.25; done
        kill -0 "$nspawn_pid" 2>/dev/null && kill -KILL "$nspawn_pid"
        wait "$nspawn_pid" 2>/dev/null
    fi
    rm -rf "/run/systemd/nspawn/propagate/$machine"
    mount | grep -q " $root" && echo "test-package-systemd: mounts left under $root" >&2
    [ "${PHUB_PKGTEST_KEEP:-0}" = 1 ] || rm -rf "$root"
}
trap cleanup EXIT

rm -rf "$root"
mkdir -p "$root"
tar -C "$root" -xf "$tarball"
# (nspawn mounts a tmpfs on /tmp: the files go to /root.)
cp "$deb" "$root/root/phub.deb"
cp "target/$profile/phub-demo" "$root/usr/local/bin/phub-demo"
pkgtest_job_spec systemd > "$root/root/job.toml"
step "root ready ($root)"

# Boots the container; sets leader (its PID 1 as the host sees it) once
# its systemd is up.
boot() {
    setsid systemd-nspawn --boot --register=no --keep-unit --private-network \
        --machine="$machine" -D "$root" >"$work/nspawn-$1.log" 2>&1 </dev/null &
    nspawn_pid=$!
    leader=
    for _ in $(seq 100); do
        leader=$(pgrep -P "$nspawn_pid" | head -1 || true)
        [ -n "$leader" ] && [ "$(cat "/proc/$leader/comm" 2>/dev/null)" = systemd ] && break
        sleep 0.1
    done
    [ -n "$leader" ] || { cat "$work/nspawn-$1.log" >&2; fail "the container did not start"; }
    # (systemctl cannot connect until the container's systemd is set up.)
    local state=
    for _ in $(seq 120); do
        state=$(ct timeout 60 systemctl is-system-running --wait 2>/dev/null || true)
        [ -n "$state" ] && [ "$state" != offline ] && break
        sleep 0.25
    done
    case "$state" in
        running | degraded) ;;
        *) cat "$work/nspawn-$1.log" >&2; fail "the container's systemd is $state" ;;
    esac
    [ "$state" = running ] || ct systemctl --failed --no-legend >&2
}
ct() { nsenter -t "$leader" -a "$@"; }
shutdown() {
    ct systemctl poweroff || true
    for _ in $(seq 100); do kill -0 "$nspawn_pid" 2>/dev/null || break; sleep 0.1; done
    kill -0 "$nspawn_pid" 2>/dev/null && fail "the container did not shut down"
    wait "$nspawn_pid" || true
    nspawn_pid=
}
show() { ct systemctl show -p "$2" --value "$1"; }
# The monotonic time phub-dataplane became active, and the one phub-control
# started (left inactive).
started_in_order() {
    local dp ctl
    dp=$(show phub-dataplane.service ActiveEnterTimestampMonotonic)
    ctl=$(show phub-control.service InactiveExitTimestampMonotonic)
    [ "$dp" -gt 0 ] && [ "$ctl" -ge "$dp" ] || fail "phub-control started ($ctl us) before phub-dataplane was up ($dp us)"
}

boot first
step "booted the root with systemd-nspawn --boot"

ct dpkg -i /root/phub.deb >/dev/null
for u in phub-dataplane phub-control; do
    [ "$(ct systemctl is-enabled $u)" = enabled ] || fail "$u not enabled by the postinst"
    [ "$(ct systemctl is-active $u || true)" = inactive ] || fail "$u started by the postinst"
done
step "installed: both units enabled, neither started"

ct systemctl start phub-control.service
for u in phub-dataplane phub-control; do
    [ "$(ct systemctl is-active $u)" = active ] || { ct journalctl -u $u --no-pager >&2; fail "$u not active"; }
done
started_in_order
step "systemctl start phub-control: phub-dataplane started first (Wants=, After=)"

phubctl() {
    ct env PHUB_CA_FILE=/etc/phub/tls/ca.crt phubctl --control https://127.0.0.1:7700 \
        --operator-token-file /var/lib/phub/control.state.json.operator-token "$@"
}
for _ in $(seq 50); do
    phubctl appliance list 2>/dev/null | grep -q ' up$' && break
    sleep 0.2
done
admit=$(phubctl --json job admit /root/job.toml)
job=$(printf '%s' "$admit" | python3 -c 'import json,sys; print(json.load(sys.stdin)["id"])')
token=$(printf '%s' "$admit" | python3 -c 'import json,sys; print(json.load(sys.stdin)["token"])')
wpids=()
for rank in 0 1; do
    ct env PHUB_CA_FILE=/etc/phub/tls/ca.crt /usr/local/bin/phub-demo worker \
        --control https://127.0.0.1:7700 --job "$job" --token "$token" --rank $rank \
        --dim 32 --hidden 32 --classes 10 --samples 512 --epochs 1 >"$work/systemd-worker$rank.log" 2>&1 &
    wpids+=($!)
done
for p in "${wpids[@]}"; do
    wait "$p" || { cat "$work"/systemd-worker*.log >&2; ct journalctl -u phub-control --no-pager >&2; fail "a worker failed"; }
done
phubctl job show "$job" | grep -q "rounds completed [1-9]" || { phubctl job show "$job" >&2; fail "no rounds completed"; }
step "job $job admitted over TLS and trained by 2 workers through the units"

old=$(show phub-dataplane.service MainPID)
ct /bin/sh -c "kill -KILL $old"
for _ in $(seq 100); do
    [ "$(show phub-dataplane.service NRestarts)" -ge 1 ] && [ "$(ct systemctl is-active phub-dataplane || true)" = active ] && break
    sleep 0.1
done
new=$(show phub-dataplane.service MainPID)
[ "$(show phub-dataplane.service NRestarts)" -ge 1 ] && [ "$new" != "$old" ] && [ "$new" != 0 ] ||
    { ct journalctl -u phub-dataplane --no-pager >&2; fail "phub-dataplane was not restarted after SIGKILL"; }
for _ in $(seq 100); do
    ct journalctl -u phub-control --no-pager | grep -q "reinstalled job $job " && break
    sleep 0.1
done
ct journalctl -u phub-control --no-pager | grep -q "reinstalled job $job " ||
    { ct journalctl -u phub-control --no-pager >&2; fail "control did not reinstall job $job on the restarted dataplane"; }
phubctl job list | grep -q ' yes$' || fail "job $job not installed after the restart"
step "SIGKILL to phub-dataplane (pid $old): systemd restarted it (pid $new), control reinstalled job $job"

journal=$(ct journalctl -u phub-dataplane -u phub-control --no-pager)
for want in "phub-dataplane: 2 udp lcore" "phub-control listening on https://" "admitted job $job" \
    "phub-dataplane.service: Main process exited, code=killed, status=9/KILL" "made the management token"; do
    grep -qF "$want" <<<"$journal" || { echo "$journal" >&2; fail "the journal has no line with: $want"; }
done
step "both daemons log to the journal"

shutdown
boot second
for u in phub-dataplane phub-control; do
    [ "$(ct systemctl is-active $u)" = active ] || { ct journalctl -b -u $u --no-pager >&2; fail "$u not started at boot"; }
done
started_in_order
step "rebooted: both units started at boot, phub-dataplane first"
shutdown
step "shut down"
echo "test-package-systemd: PASS in $(( $(date +%s) - t0 ))s"
