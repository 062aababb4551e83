# phub: the two commands of the README, and their parts.
#   make demo   runs the main job
#   make test   runs every test (and the format and lint gates)
CARGO ?= cargo

.PHONY: demo test setup build lint unit fuzz bench-kernels

setup:
	./tools/setup.sh

build: setup
	$(CARGO) build --workspace --all-targets

demo: setup
	@echo "phub demo: the end-to-end demo (phub-control + phub-dataplane + W worker"
	@echo "processes training a small model on loopback) arrives with the end-to-end"
	@echo "issue. Until then this runs what exists: the aggregation-kernel benchmark."
	$(CARGO) run --release -p phub-tools --bin phub-bench -- kernels --out-mib 64 --reps 3

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
