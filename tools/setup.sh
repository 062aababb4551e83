#!/usr/bin/env bash
# Installs what building and testing phub needs on a fresh Debian/Ubuntu
# machine, then returns. Safe to run again: it installs only what is missing.
# Uses sudo where not root. The Rust toolchain itself (cargo, rustc, rustfmt,
# clippy) is assumed, as the README says.
set -euo pipefail

# System packages each part needs. The engine, protocol and tools are pure
# Rust; later parts (the DPDK backend, hwloc) add their -dev packages here.
# libhwloc-dev: NUMA topology (hwlocality); libudev-dev: hwloc links it.
# libdpdk-dev: the DPDK backend (phub-ffi links it; DPDK >= 22.11);
# libclang-dev: bindgen, which generates phub-ffi's bindings; iproute2: the
# DPDK tests' network namespaces and veth pairs; dpdk-dev: dpdk-testpmd,
# which `phub-bench run --local --backend dpdk` measures the veth ceiling with.
# dpdk: DPDK's dpdk-hugepages.py and dpdk-devbind.py, which phub-setup runs
# (tests/it/packaging.rs runs `phub-setup hugepages` as root).
# nftables: `phub-bench run --local --racks R --spine-loss PCT` drops datagrams
# on the spine hop alone (netem does not exist on these kernels).
# python3, python3-venv, python3-dev: the Python package (python/): PyO3's
# build script needs an interpreter, `cargo build` of its cdylib links
# libpython, and the Python tests run in a venv.
# fonts-dejavu-core: the labels of phub-bench's PNG plots (--plot F.png, in
# a phub-bench built with --features png).
# dpkg-dev, binutils: `make deb` (dpkg-shlibdeps computes the package's
# Depends; objcopy strips the binaries). `make test-package` installs its own
# (mmdebstrap).
# mold: the linker (.cargo/config.toml, tools/link-gcc; GNU ld where missing).
# etcd-server: etcd, which tests/it/etcd.rs starts on loopback (phub-control
# --state etcd://...).
PACKAGES=(pkg-config mold libhwloc-dev libudev-dev libdpdk-dev dpdk-dev dpdk libclang-dev iproute2 nftables python3 python3-venv python3-dev fonts-dejavu-core dpkg-dev binutils etcd-server)

need=()
for p in "${PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || need+=("$p")
done
if ((${#need[@]})); then
    SUDO=""
    [ "$(id -u)" -eq 0 ] || SUDO="sudo"
    echo "setup: installing ${need[*]}"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${need[@]}"
fi

command -v cargo >/dev/null || { echo "setup: cargo not found: install Rust from https://rustup.rs" >&2; exit 1; }
for c in rustfmt clippy; do
    if ! cargo "${c/rustfmt/fmt}" --version >/dev/null 2>&1; then
        command -v rustup >/dev/null && rustup component add "$c" || { echo "setup: cargo $c missing" >&2; exit 1; }
    fi
done
