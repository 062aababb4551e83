# phub: the two commands of the README, and their parts.
#   make demo   runs the main job
#   make test   runs every test (and the format and lint gates)
CARGO ?= cargo

.PHONY: demo test setup build lint unit fuzz bench-kernels

setup:
	./tools/setup.sh

build: setup
	$(CARGO) build --workspace --all-targets

# Starts phub-dataplane (kernel UDP on loopback) and phub-control, admits a
# job and trains an MLP with DEMO_WORKERS worker processes; see README.
DEMO_WORKERS ?= 3
demo: setup
	$(CARGO) build --release -p phub --bins
	./target/release/phub-demo --workers $(DEMO_WORKERS)

lint: setup
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --workspace --all-targets -- -D warnings

unit: setup
	$(CARGO) test --workspace

test: lint unit

# Not part of `make test`: runs each fuzz target for FUZZ_SECONDS (nightly).
FUZZ_SECONDS ?= 60
fuzz:
	./tools/fuzz.sh $(FUZZ_SECONDS)

bench-kernels: setup
	$(CARGO) run --release -p phub-tools --bin phub-bench -- kernels --json target/kernels.json
