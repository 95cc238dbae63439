#!/usr/bin/env bash
# The long failure-injection campaign (README, "Crash safety"): builds the
# services with their failure points and runs `adchaos` against real NATS,
# etcd and S3 processes. Arguments go to adchaos, e.g. --rounds 200 --seed 42.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
bash scripts/install-deps.sh test
# A target directory of its own: other builds in target/ (without failure
# points) must not replace the binaries the campaign keeps restarting.
# Release builds with the failure points compiled in: a debug aggregator
# spends seconds rebuilding a dedupe window of millions of ids at each
# restart, which would dominate the round times of a long campaign.
export CARGO_TARGET_DIR="$root/target/chaos"
echo "chaos: building the services and adchaos (release, with failure points) into $CARGO_TARGET_DIR"
cargo build --release -p adspend-limiter -p adspend-aggregator -p adspend-pacer -p adspend-chaos --bins --features adspend-limiter/failpoints,adspend-aggregator/failpoints,adspend-pacer/failpoints
exec "$CARGO_TARGET_DIR/release/adchaos" "$@"
