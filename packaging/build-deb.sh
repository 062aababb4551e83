#!/usr/bin/env bash
# Builds target/debian/phub_<version>_<arch>.deb with dpkg-deb from the
# release binaries (no cargo-deb: nothing to install, and the package's
# layout is all here). Depends are computed by dpkg-shlibdeps from the
# binaries (the dataplane links DPDK 22.11 and hwloc).
#   PHUB_DEB_NO_BUILD=1  package target/release as it is (no cargo build)
#   PHUB_DEB_VERSION=V   the package's version (default: the workspace's)
#   PHUB_DEB_PROFILE=debug  package target/debug's binaries (the dev
#                        profile `cargo test` builds: for the install test
#                        in CI, never for shipping); default release
#   CARGO_TARGET_DIR=D   the binaries are under D (default target), and the
#                        package is written to D/debian
#   PHUB_DEB_FEATURES=F  cargo's feature arguments for the build, e.g.
#                        --no-default-features (no DPDK backend); by default
#                        the DPDK backend is built where pkg-config finds
#                        libdpdk 22.11 or later, and left out (saying so)
#                        where it finds an older one or none (Ubuntu 22.04
#                        has 21.11): the dataplane then has kernel UDP only
# Prints the .deb's path on its last line.
set -euo pipefail
cd "$(dirname "$0")/.."
CARGO=${CARGO:-cargo}
BINS=(phub-dataplane phub-control phubctl phub-setup)

profile=${PHUB_DEB_PROFILE:-release}
case "$profile" in
    release) profile_flag=(--release) ;;
    debug) profile_flag=() ;;
    *) echo "build-deb: PHUB_DEB_PROFILE=$profile: expected release or debug" >&2; exit 1 ;;
esac
if [ "${PHUB_DEB_NO_BUILD:-0}" != 1 ]; then
    args=()
    for b in "${BINS[@]}"; do args+=(--bin "$b"); done
    if [ -n "${PHUB_DEB_FEATURES+set}" ]; then
        read -r -a features <<< "$PHUB_DEB_FEATURES"
    elif pkg-config --atleast-version=22.11 libdpdk 2>/dev/null; then
        features=()
    else
        found=$(pkg-config --modversion libdpdk 2>/dev/null || echo none)
        echo "build-deb: libdpdk $found found, phub's DPDK backend needs 22.11 or later:" \
            "building without it (--no-default-features; kernel UDP only)" >&2
        features=(--no-default-features)
    fi
    $CARGO build "${profile_flag[@]}" "${features[@]}" -p phub "${args[@]}" >&2
fi
command -v dpkg-shlibdeps >/dev/null || { echo "build-deb: dpkg-shlibdeps missing (apt install dpkg-dev)" >&2; exit 1; }

target_dir=${CARGO_TARGET_DIR:-target}
version=${PHUB_DEB_VERSION:-$(sed -n 's/^version = "\(.*\)"$/\1/p' Cargo.toml | head -1)}
arch=$(dpkg --print-architecture)
name="phub_${version}_${arch}"
out=$target_dir/debian
root="$out/$name"
rm -rf "$root"
mkdir -p "$root/DEBIAN" "$root/usr/bin" "$root/etc/phub" "$root/lib/systemd/system" \
    "$root/usr/share/doc/phub" "$root/usr/share/phub/grafana"

for b in "${BINS[@]}"; do
    # The release profile keeps line tables (debug = 1): drop them here.
    objcopy --strip-debug "$target_dir/$profile/$b" "$root/usr/bin/$b"
    chmod 755 "$root/usr/bin/$b"
done
install -m 644 packaging/etc/phub/dataplane.toml packaging/etc/phub/control.toml "$root/etc/phub/"
install -m 644 packaging/systemd/phub-dataplane.service packaging/systemd/phub-control.service \
    "$root/lib/systemd/system/"
for d in README.md PROTOCOL.md docs/OPERATING.md; do
    [ -f "$d" ] && install -m 644 "$d" "$root/usr/share/doc/phub/"
done
[ -f packaging/grafana/phub.json ] && install -m 644 packaging/grafana/phub.json "$root/usr/share/phub/grafana/"
printf 'phub\nLicense: Apache-2.0\n' > "$root/usr/share/doc/phub/copyright"
install -m 755 packaging/deb/postinst packaging/deb/prerm packaging/deb/postrm "$root/DEBIAN/"
printf '/etc/phub/dataplane.toml\n/etc/phub/control.toml\n' > "$root/DEBIAN/conffiles"

# Shared-library dependencies, as dpkg-shlibdeps reads them.
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
mkdir "$tmp/debian"
printf 'Source: phub\n\nPackage: phub\nArchitecture: any\n' > "$tmp/debian/control"
abs=$(realpath "$root")
shlibs=$(cd "$tmp" && dpkg-shlibdeps -O "$abs"/usr/bin/* 2>/dev/null | sed -n 's/^shlibs:Depends=//p')
[ -n "$shlibs" ] || { echo "build-deb: dpkg-shlibdeps found no dependencies" >&2; exit 1; }

size=$(du -sk --exclude=DEBIAN "$root" | cut -f1)
cat > "$root/DEBIAN/control" <<CONTROL
Package: phub
Version: $version
Architecture: $arch
Maintainer: phub maintainers <phub@example.invalid>
Installed-Size: $size
Depends: $shlibs, adduser
Recommends: systemd, dpdk
Section: net
Priority: optional
Homepage: https://example.invalid/phub
Description: rack-scale parameter server appliance
 phub aggregates gradients of distributed training jobs in an appliance on
 the network: phub-dataplane (kernel UDP or DPDK) sums and runs the
 optimizer, phub-control admits jobs and places them, phubctl operates it.
 Systemd units, /etc/phub configuration, TLS set up by phub-setup.
CONTROL
dpkg-deb --root-owner-group -Zgzip --build "$root" "$out/$name.deb" >&2
echo "$out/$name.deb"
