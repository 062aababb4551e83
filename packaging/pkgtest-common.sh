# Sourced by test-package.sh and test-package-systemd.sh: what both install
# tests start from. The caller defines step() and runs as root.
#   pkgtest_need PKG...  installs the host packages missing
#   pkgtest_deb          builds the package; sets deb and profile
#                        (PHUB_DEB_PROFILE, PHUB_PKGTEST_NO_BUILD as in
#                        test-package.sh)
#   pkgtest_tarball      sets tarball: a Debian 12 minbase root with the
#                        package's Depends and systemd (mmdebstrap from the
#                        package registry), cached under target/pkgtest as
#                        a tarball named by what it holds
#   pkgtest_job_spec N   prints the job spec (named N) the tests train
#   pkgtest_build_deb    runs build-deb.sh (PHUB_DEB_NO_BUILD=1) with the
#                        caller's environment where the package is built
#
# PHUB_PKGTEST_DIST=noble (or jammy) tests an Ubuntu 24.04 (22.04) package
# instead (make test-package-ubuntu, test-package-ubuntu-22.04): the
# binaries and the package are built in an Ubuntu root of that release
# (tools/setup.sh's build packages from DIST, DIST-updates and
# DIST-security; this machine's rustup toolchain and ~/.cargo
# bind-mounted; CARGO_TARGET_DIR target/DIST), so dpkg-shlibdeps names its
# libraries, and the install root is one of that release. Both roots are
# cached under target/pkgtest-DIST. jammy's DPDK (21.11) is older than
# phub-ffi's API (22.11): its package is built without the `dpdk` feature
# (kernel-UDP backend only) and its build root has no libdpdk-dev. Debian
# 12's archive has no Ubuntu keyring (ubuntu-keyring is not in bookworm),
# so the Ubuntu sources are [trusted=yes]: what is fetched is not verified.
pkgtest_dist=${PHUB_PKGTEST_DIST:-bookworm}
pkgtest_features=()
case "$pkgtest_dist" in
    bookworm) pkgtest_work=target/pkgtest; pkgtest_target=target ;;
    noble) pkgtest_work=target/pkgtest-noble; pkgtest_target=target/noble; pkgtest_release="Ubuntu 24.04" ;;
    jammy)
        pkgtest_work=target/pkgtest-jammy; pkgtest_target=target/jammy; pkgtest_release="Ubuntu 22.04"
        pkgtest_features=(--no-default-features)
        ;;
    *) echo "pkgtest: PHUB_PKGTEST_DIST=$pkgtest_dist: expected bookworm, noble or jammy" >&2; exit 1 ;;
esac
# Whether the package is built and installed in Ubuntu roots.
pkgtest_ubuntu() { [ "$pkgtest_dist" != bookworm ]; }
pkgtest_mirror=http://archive.ubuntu.com/ubuntu
# mmdebstrap's arguments for an Ubuntu release: suite, then (after the
# target) the sources.
pkgtest_ubuntu_sources=()
for s in "$pkgtest_dist" "$pkgtest_dist-updates" "$pkgtest_dist-security"; do
    pkgtest_ubuntu_sources+=("deb [trusted=yes] $pkgtest_mirror $s main universe")
done
# What the Ubuntu build root holds: tools/setup.sh's build packages (no
# DPDK for a build without the `dpdk` feature).
pkgtest_ubuntu_build_pkgs=ca-certificates,build-essential,pkg-config,libhwloc-dev,libudev-dev,libclang-dev,dpkg-dev,binutils
((${#pkgtest_features[@]})) || pkgtest_ubuntu_build_pkgs+=,libdpdk-dev

pkgtest_need() {
    local need=() p
    for p in "$@"; do
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || need+=("$p")
    done
    if ((${#need[@]})); then
        step "installing ${need[*]}"
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
    fi
}

# The Ubuntu build root, made once (a directory, named by what it holds).
pkgtest_ubuntu_build_root() {
    local stamp
    mkdir -p "$pkgtest_work"
    build_root=$(realpath "$pkgtest_work")/build
    stamp=$(printf '%s' "$pkgtest_ubuntu_build_pkgs" | sha256sum | cut -c1-12)
    if [ "$(cat "$build_root.stamp" 2>/dev/null)" != "$stamp" ]; then
        step "making an $pkgtest_release build root with mmdebstrap (cached as $build_root)"
        pkgtest_umount_build_root
        rm -rf "$build_root" "$build_root.stamp"
        mmdebstrap --quiet --variant=minbase --include="$pkgtest_ubuntu_build_pkgs" "$pkgtest_dist" \
            "$build_root" "${pkgtest_ubuntu_sources[@]}"
        echo "$stamp" > "$build_root.stamp"
    fi
}
pkgtest_umount_build_root() {
    local m
    for m in root/.cargo root/.rustup src dev proc; do
        mountpoint -q "$build_root/$m" 2>/dev/null && umount -l "$build_root/$m"
    done
    return 0
}
# Runs a command in the Ubuntu build root, in /src (this checkout), with the
# rustup toolchain (read-only) and ~/.cargo (the registry cache) mounted.
pkgtest_in_build_root() (
    trap pkgtest_umount_build_root EXIT
    local tc
    tc=$(rustup show active-toolchain | cut -d' ' -f1)
    [ -n "$tc" ] || { echo "pkgtest: no default rustup toolchain" >&2; exit 1; }
    mkdir -p "$build_root/src" "$build_root/root/.rustup" "$build_root/root/.cargo"
    cp /etc/resolv.conf "$build_root/etc/resolv.conf"
    mount -t proc proc "$build_root/proc"
    mount --bind /dev "$build_root/dev"
    mount --bind "$PWD" "$build_root/src"
    mount --bind "$HOME/.rustup" "$build_root/root/.rustup"
    mount -o remount,bind,ro "$build_root/root/.rustup"
    mount --bind "$HOME/.cargo" "$build_root/root/.cargo"
    chroot "$build_root" env -i HOME=/root TERM=dumb \
        PATH="/root/.rustup/toolchains/$tc/bin:/usr/sbin:/usr/bin:/sbin:/bin" \
        CARGO_TARGET_DIR=/src/$pkgtest_target \
        ${PHUB_DEB_PROFILE:+PHUB_DEB_PROFILE=$PHUB_DEB_PROFILE} \
        ${PHUB_DEB_VERSION:+PHUB_DEB_VERSION=$PHUB_DEB_VERSION} \
        sh -c 'cd /src && exec "$@"' sh "$@"
)

pkgtest_build_deb() {
    if pkgtest_ubuntu; then
        # (It prints the path in the root: /src is this checkout.)
        pkgtest_in_build_root env PHUB_DEB_NO_BUILD=1 ./packaging/build-deb.sh | sed 's|^/src/||'
    else
        PHUB_DEB_NO_BUILD=1 ./packaging/build-deb.sh
    fi
}

pkgtest_deb() {
    # Where cargo runs: here, or in the Ubuntu build root.
    local run=() what="building the package"
    if pkgtest_ubuntu; then
        pkgtest_ubuntu_build_root
        run=(pkgtest_in_build_root)
        what="building the package in the $pkgtest_release root (CARGO_TARGET_DIR $pkgtest_target${pkgtest_features[*]:+, ${pkgtest_features[*]}})"
    fi
    step "$what"
    # One cargo run for the package's binaries and the demo's worker (which
    # trains the job): the release link is the slow part.
    profile=${PHUB_DEB_PROFILE:-release}
    local profile_flag=()
    [ "$profile" = debug ] || profile_flag=(--release)
    [ "${PHUB_PKGTEST_NO_BUILD:-0}" = 1 ] ||
        "${run[@]}" cargo build "${profile_flag[@]}" "${pkgtest_features[@]}" -p phub --bin phub-dataplane \
            --bin phub-control --bin phubctl --bin phub-setup --bin phub-demo >&2
    deb=$(pkgtest_build_deb | tail -1)
    step "built $deb ($(du -h "$deb" | cut -f1))"
}

# Writes the install tests' job spec, named $1, to standard output: the
# model phub-demo's workers train (--dim 32 --hidden 32 --classes 10).
pkgtest_job_spec() {
    cat <<SPEC
name = "$1"
workers = 2
dtype = "f32"
chunk_bytes = 8192

[optimizer]
kind = "sgd"
lr = 0.1

[[keys]]
name = "fc1.weight"
elements = 1024
[[keys]]
name = "fc1.bias"
elements = 32
[[keys]]
name = "fc2.weight"
elements = 320
[[keys]]
name = "fc2.bias"
elements = 10
SPEC
}

pkgtest_tarball() {
    local work=$pkgtest_work deps include
    mkdir -p "$work"
    deps=$(dpkg-deb -f "$deb" Depends | tr ',' '\n' | sed 's/|.*//; s/(.*)//; s/ //g' | grep -v '^$' | sort -u | paste -sd, -)
    include="$deps,systemd,ca-certificates"
    tarball="$work/$pkgtest_dist-$(printf '%s' "$include" | sha256sum | cut -c1-12).tar"
    if [ ! -s "$tarball" ]; then
        step "making a $pkgtest_dist root with mmdebstrap (cached as $tarball)"
        rm -f "$work/$pkgtest_dist"-*.tar
        # (mmdebstrap writes a tarball when the name ends in .tar.)
        if pkgtest_ubuntu; then
            mmdebstrap --quiet --variant=minbase --include="$include" "$pkgtest_dist" "$work/partial.tar" \
                "${pkgtest_ubuntu_sources[@]}"
        else
            mmdebstrap --quiet --variant=minbase --include="$include" bookworm "$work/partial.tar" \
                http://deb.debian.org/debian
        fi
        mv "$work/partial.tar" "$tarball"
    fi
}
