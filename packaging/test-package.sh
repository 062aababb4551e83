#!/usr/bin/env bash
# make test-package: builds the .deb, installs it into a fresh Debian 12 root
# (mmdebstrap from the package registry, cached under target/pkgtest), checks
# the files, verifies the units, starts both daemons the way their units
# would (the units' ExecStartPre/ExecStart lines, the shipped configs, the
# units' users, runtime and state directories) in a private network
# namespace, admits a job over TLS with the installed phubctl and the CA the
# package made, trains it with 2 workers, then removes the package and checks
# that nothing but the kept state is left. Needs root (chroot, mounts,
# network namespaces). Prints how long each part took.
#   PHUB_PKGTEST_KEEP=1      leave target/pkgtest/root for inspection
#   PHUB_PKGTEST_NO_BUILD=1  package the binaries as they are (no cargo build)
#   PHUB_DEB_PROFILE=debug   package target/debug's binaries, which `make
#                            test` has just built (CI: no release build)
#   PHUB_PKGTEST_DIST=noble  the same test for Ubuntu 24.04 (jammy: 22.04,
#                            kernel-UDP backend only): the package is
#                            built in a root of that release and installed in another
#                            (pkgtest-common.sh; make test-package-ubuntu)
set -euo pipefail
cd "$(dirname "$0")/.."
[ "$(id -u)" -eq 0 ] || { echo "test-package: needs root (chroot, mounts, network namespaces)" >&2; exit 1; }

t0=$(date +%s)
step() { echo "test-package [$(( $(date +%s) - t0 ))s]: $*"; }

# What the test needs on the host: mmdebstrap (the root), dpkg-dev
# (dpkg-shlibdeps, for the package's Depends), iproute2 (the namespace),
# systemd (systemd-analyze).
. packaging/pkgtest-common.sh
pkgtest_need mmdebstrap dpkg-dev iproute2 systemd
pkgtest_deb
pkgtest_tarball
work=$pkgtest_work

root=$(realpath "$work")/root
ns="phub-pkgtest-$$"
pids=()
cleanup() {
    set +e
    for p in "${pids[@]}"; do kill "$p" 2>/dev/null; done
    for p in "${pids[@]}"; do wait "$p" 2>/dev/null; done
    for m in run dev/pts dev sys proc; do
        mountpoint -q "$root/$m" && umount -l "$root/$m"
    done
    ip netns del "$ns" 2>/dev/null
    ip netns del "$ns-w" 2>/dev/null
    [ "${PHUB_PKGTEST_KEEP:-0}" = 1 ] || rm -rf "$root"
}
trap cleanup EXIT
# A root left by an interrupted run: unmount before removing anything.
for m in run dev/pts dev sys proc; do
    mountpoint -q "$root/$m" 2>/dev/null && umount -l "$root/$m"
done
rm -rf "$root"
mkdir -p "$root"
tar -C "$root" -xf "$tarball"
mount -t proc proc "$root/proc"
mount --bind /sys "$root/sys"
mount --bind /dev "$root/dev"
mount --bind /dev/pts "$root/dev/pts"
mount -t tmpfs -o mode=0755 tmpfs "$root/run"
step "root ready"

# Install.
cp "$deb" "$root/tmp/phub.deb"
chroot "$root" dpkg -i /tmp/phub.deb
step "installed"

# The files.
for f in /usr/bin/phub-dataplane /usr/bin/phub-control /usr/bin/phubctl /usr/bin/phub-setup \
    /etc/phub/dataplane.toml /etc/phub/control.toml \
    /lib/systemd/system/phub-dataplane.service /lib/systemd/system/phub-control.service \
    /etc/phub/tls/ca.crt /etc/phub/tls/server.crt /etc/phub/tls/server.key /etc/phub/tls/ca.key \
    /usr/share/doc/phub/OPERATING.md /usr/share/phub/grafana/phub.json; do
    [ -e "$root$f" ] || { echo "test-package: $f missing after install" >&2; exit 1; }
done
chroot "$root" getent passwd phub >/dev/null || { echo "test-package: no phub user" >&2; exit 1; }
[ "$(chroot "$root" stat -c '%U %a' /etc/phub/tls/server.key)" = "phub 600" ] || {
    echo "test-package: server.key is $(chroot "$root" stat -c '%U %a' /etc/phub/tls/server.key), expected phub 600" >&2; exit 1; }
[ "$(chroot "$root" stat -c '%U %a' /etc/phub/tls/ca.key)" = "root 600" ] || {
    echo "test-package: ca.key is $(chroot "$root" stat -c '%U %a' /etc/phub/tls/ca.key), expected root 600" >&2; exit 1; }
[ "$(chroot "$root" stat -c '%U' /var/lib/phub)" = phub ] || { echo "test-package: /var/lib/phub not owned by phub" >&2; exit 1; }
step "files, user and modes as expected"

# The units, as systemd reads them in the installed root.
chroot "$root" systemd-analyze verify /lib/systemd/system/phub-dataplane.service \
    /lib/systemd/system/phub-control.service
step "systemd-analyze verify: clean"

# Configure as an operator would for workers on another host: the
# dataplane's data address, and a server certificate naming control's
# address (docs/OPERATING.md, "Configure" and "TLS"). The appliance is a
# network namespace of its own (no clash with this host's ports), the
# workers' host another, joined by a veth pair.
appliance_ip=10.99.0.1
worker_ip=10.99.0.2
sed -i "s/^# host = \"127.0.0.1\"$/host = \"$appliance_ip\"/" "$root/etc/phub/dataplane.toml"
grep -q "^host = \"$appliance_ip\"" "$root/etc/phub/dataplane.toml" || { echo "test-package: could not set host" >&2; exit 1; }
chroot "$root" phub-setup tls --force --san "$appliance_ip"
unit_lines() { sed -n "s/^$2=//p" "$root/lib/systemd/system/$1"; }
ip netns add "$ns"
ip netns add "$ns-w"
ip -n "$ns" link set lo up
ip -n "$ns-w" link set lo up
ip link add "pkgt$$a" netns "$ns" type veth peer name "pkgt$$b" netns "$ns-w"
ip -n "$ns" addr add "$appliance_ip/24" dev "pkgt$$a"
ip -n "$ns-w" addr add "$worker_ip/24" dev "pkgt$$b"
ip -n "$ns" link set "pkgt$$a" up
ip -n "$ns-w" link set "pkgt$$b" up
start_daemons() {
    # phub-dataplane.service: RuntimeDirectory=phub (0755), ExecStartPre, ExecStart, as root.
    install -d -m 0755 "$root/run/phub"
    while read -r pre; do
        ip netns exec "$ns" chroot "$root" $pre
    done < <(unit_lines phub-dataplane.service ExecStartPre)
    dp_exec=$(unit_lines phub-dataplane.service ExecStart)
    ip netns exec "$ns" chroot "$root" env RUST_LOG=info $dp_exec >"$work/dataplane.log" 2>&1 &
    pids+=($!)
    # phub-control.service: User=phub, StateDirectory=phub, WorkingDirectory=/var/lib/phub.
    ctl_exec=$(unit_lines phub-control.service ExecStart)
    ip netns exec "$ns" chroot --userspec=phub:phub "$root" /bin/sh -c "cd /var/lib/phub && RUST_LOG=info exec $ctl_exec" \
        >"$work/control.log" 2>&1 &
    pids+=($!)
    for _ in $(seq 100); do
        grep -q "listening on" "$work/control.log" 2>/dev/null && break
        sleep 0.1
    done
    grep -q "listening on https://0.0.0.0:7700" "$work/control.log" || {
        echo "test-package: phub-control did not start with TLS:" >&2; cat "$work/control.log" "$work/dataplane.log" >&2; exit 1; }
}
start_daemons
step "daemons started (control on https, as phub)"

# Admit over TLS from the workers' namespace with the installed phubctl,
# the operator token and the CA.
pkgtest_job_spec pkgtest > "$root/tmp/job.toml"
phubctl() {
    ip netns exec "$ns-w" chroot "$root" env PHUB_CA_FILE=/etc/phub/tls/ca.crt \
        phubctl --control "https://$appliance_ip:7700" \
        --operator-token-file /var/lib/phub/control.state.json.operator-token "$@"
}
# Control reaches the dataplane on its first reconciliation.
for _ in $(seq 50); do
    phubctl appliance list 2>/dev/null | grep -q up && break
    sleep 0.2
done
admit=$(phubctl --json job admit /tmp/job.toml)
job=$(printf '%s' "$admit" | python3 -c 'import json,sys; print(json.load(sys.stdin)["id"])')
token=$(printf '%s' "$admit" | python3 -c 'import json,sys; print(json.load(sys.stdin)["token"])')   # hex
step "job $job admitted over TLS from another network namespace"

# Two workers (the demo's, from this build) train it through the daemons.
# An Ubuntu build needs that release's libraries: there the workers run in
# the root.
if pkgtest_ubuntu; then
    cp "$pkgtest_target/$profile/phub-demo" "$root/tmp/phub-demo"
    demo=(chroot "$root" env PHUB_CA_FILE=/etc/phub/tls/ca.crt /tmp/phub-demo)
else
    demo=(env PHUB_CA_FILE="$root/etc/phub/tls/ca.crt" "./target/$profile/phub-demo")
fi
wpids=()
for rank in 0 1; do
    ip netns exec "$ns-w" "${demo[@]}" worker \
        --control "https://$appliance_ip:7700" --job "$job" --token "$token" --rank $rank \
        --dim 32 --hidden 32 --classes 10 --samples 512 --epochs 1 >"$work/worker$rank.log" 2>&1 &
    wpids+=($!)
done
for p in "${wpids[@]}"; do
    wait "$p" || { echo "test-package: a worker failed:" >&2; cat "$work"/worker*.log "$work/control.log" >&2; exit 1; }
done
phubctl job show "$job"
step "job $job trained by 2 workers"

# Upgrade with the job checkpointed: the state file, the checkpoint, the
# operator token and the CA must survive, and control must reinstall the
# job from its checkpoint on the new package's dataplane.
phubctl job checkpoint "$job"
ckpt="$root/var/lib/phub/control.state.json.job-$job.ckpt"
[ -s "$ckpt" ] || { echo "test-package: no checkpoint at ${ckpt#$root}" >&2; ls -la "$root/var/lib/phub" >&2; exit 1; }
stop_daemons() {
    for p in "${pids[@]}"; do kill -TERM "$p"; done
    for p in "${pids[@]}"; do wait "$p" || true; done
    pids=()
    rm -rf "$root/run/phub"   # RuntimeDirectory= goes when its unit stops
}
stop_daemons   # as the old package's units stop in an upgrade
grep -q "phub-control stopped" "$work/control.log" || { echo "test-package: control did not stop cleanly" >&2; exit 1; }
kept() { (cd "$root" && sha256sum var/lib/phub/control.state.json "${ckpt#$root/}" \
    var/lib/phub/control.state.json.operator-token etc/phub/tls/*); }
before=$(kept)
version=$(dpkg-deb -f "$deb" Version)
deb2=$(PHUB_DEB_VERSION="$version+pkgtest1" pkgtest_build_deb | tail -1)
cp "$deb2" "$root/tmp/phub2.deb"
chroot "$root" dpkg -i /tmp/phub2.deb
[ "$(chroot "$root" dpkg-query -W -f='${Version}' phub)" = "$version+pkgtest1" ] || { echo "test-package: upgrade not installed" >&2; exit 1; }
[ "$(kept)" = "$before" ] || { echo "test-package: the upgrade changed kept files:" >&2; diff <(echo "$before") <(kept) >&2; exit 1; }
start_daemons
grep -q "reinstalled job $job .* from its checkpoint" "$work/control.log" || {
    for _ in $(seq 100); do
        grep -q "reinstalled job $job .* from its checkpoint" "$work/control.log" && break
        sleep 0.1
    done
}
grep -q "reinstalled job $job .* from its checkpoint" "$work/control.log" || {
    echo "test-package: control did not reinstall job $job from its checkpoint after the upgrade:" >&2
    cat "$work/control.log" >&2; exit 1; }
phubctl job list | grep -q pkgtest || { echo "test-package: job $job lost in the upgrade" >&2; exit 1; }
step "upgraded to $version+pkgtest1: state, checkpoint, token and CA kept; job $job reinstalled from its checkpoint"

stop_daemons
grep -q "phub-control stopped" "$work/control.log" || { echo "test-package: control did not stop cleanly" >&2; exit 1; }
chroot "$root" dpkg -r phub
for f in /usr/bin/phub-dataplane /usr/bin/phub-control /usr/bin/phubctl /usr/bin/phub-setup \
    /lib/systemd/system/phub-dataplane.service /lib/systemd/system/phub-control.service; do
    [ ! -e "$root$f" ] || { echo "test-package: $f left after dpkg -r" >&2; exit 1; }
done
# Kept by remove: the configuration and the state (the job is recorded).
[ -s "$root/var/lib/phub/control.state.json" ] || { echo "test-package: state file lost by dpkg -r" >&2; exit 1; }
chroot "$root" dpkg --purge phub
[ ! -e "$root/etc/phub" ] && [ ! -e "$root/var/lib/phub" ] || { echo "test-package: purge left /etc/phub or /var/lib/phub" >&2; exit 1; }
step "removed and purged cleanly"
echo "test-package: PASS in $(( $(date +%s) - t0 ))s"
