#!/usr/bin/env bash
# Installs what building and testing phub needs on a fresh Debian/Ubuntu
# machine, then returns. Safe to run again: it installs only what is missing.
# Uses sudo where not root. The Rust toolchain itself (cargo, rustc, rustfmt,
# clippy) is assumed, as the README says.
set -euo pipefail

# System packages each part needs. The engine, protocol and tools are pure
# Rust; later parts (the DPDK backend, hwloc) add their -dev packages here.
# libhwloc-dev: NUMA topology (hwlocality); libudev-dev: hwloc links it.
PACKAGES=(pkg-config libhwloc-dev libudev-dev)

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
