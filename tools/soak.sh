#!/usr/bin/env bash
# The soak (not part of `make test`): two jobs with 5% loss in each direction
# and a flood of bad packets for SECONDS (default 60); prints rounds done,
# retransmissions, drops and the dataplane's memory at start and end.
set -euo pipefail
cd "$(dirname "$0")/.."
PHUB_SOAK_SECS="${1:-60}" cargo test --release -p phub --test it soak:: -- --ignored --nocapture
