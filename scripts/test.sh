#!/usr/bin/env bash
# Installs the test dependencies (nats-server, etcd, protoc, an S3-compatible
# server) and runs every check CI runs: formatting, clippy, the whole test
# suite against real NATS / etcd / S3 processes.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
bash scripts/install-deps.sh test
echo "test: cargo fmt --check"
cargo fmt --all --check
echo "test: cargo clippy"
cargo clippy --workspace --all-targets --features adspend-tests/failpoints -- -D warnings
# The suite crashes real processes at named failure points: build and test
# with them compiled in (inert unless a test arms one; release builds have none).
features=(--features adspend-tests/failpoints)
echo "test: building service binaries (the integration suite runs them as processes)"
cargo build --workspace --bins "${features[@]}"
echo "test: cargo test"
# Integration tests each start their own servers; three at a time fits 2 cores.
log=$(mktemp)
trap 'rm -f "$log"' EXIT
set +e
cargo test --workspace --lib --bins --tests "${features[@]}" -- --test-threads=3 2>&1 | tee "$log"
status=${PIPESTATUS[0]}
set -e
passed=$(grep -Eo '^test result: [a-zA-Z]+\. [0-9]+ passed' "$log" | awk '{s += $4} END {print s + 0}')
failed=$(grep -Eo '[0-9]+ failed;' "$log" | awk '{s += $1} END {print s + 0}')
echo "tests: $passed passed, $failed failed"
exit "$status"
