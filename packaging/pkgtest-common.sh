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

pkgtest_deb() {
    step "building the package"
    # One cargo run for the package's binaries and the demo's worker (which
    # trains the job): the release link is the slow part.
    profile=${PHUB_DEB_PROFILE:-release}
    local profile_flag=()
    [ "$profile" = debug ] || profile_flag=(--release)
    [ "${PHUB_PKGTEST_NO_BUILD:-0}" = 1 ] ||
        cargo build "${profile_flag[@]}" -p phub --bin phub-dataplane --bin phub-control --bin phubctl \
            --bin phub-setup --bin phub-demo >&2
    deb=$(PHUB_DEB_NO_BUILD=1 ./packaging/build-deb.sh | tail -1)
    step "built $deb ($(du -h "$deb" | cut -f1))"
}

pkgtest_tarball() {
    local work=target/pkgtest deps include
    mkdir -p "$work"
    deps=$(dpkg-deb -f "$deb" Depends | tr ',' '\n' | sed 's/|.*//; s/(.*)//; s/ //g' | grep -v '^$' | sort -u | paste -sd, -)
    include="$deps,systemd,ca-certificates"
    tarball="$work/bookworm-$(printf '%s' "$include" | sha256sum | cut -c1-12).tar"
    if [ ! -s "$tarball" ]; then
        step "making a Debian 12 root with mmdebstrap (cached as $tarball)"
        rm -f "$work"/bookworm-*.tar
        # (mmdebstrap writes a tarball when the name ends in .tar.)
        mmdebstrap --quiet --variant=minbase --include="$include" bookworm "$work/partial.tar" \
            http://deb.debian.org/debian
        mv "$work/partial.tar" "$tarball"
    fi
}
