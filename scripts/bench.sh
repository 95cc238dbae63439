#!/usr/bin/env bash
# The benchmark suite in one command: installs what it needs (NATS, etcd,
# moto, redis-server), builds the workspace in release and runs `adbench`,
# which prints every figure as it goes and writes the results table to
# target/bench/results.md (docs/BENCHMARKS.md quotes it).
#
#   scripts/bench.sh                      # everything, 3 runs each (~30 min)
#   scripts/bench.sh --sections apply     # one section; --help lists the options
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
bash scripts/install-deps.sh bench
echo "bench: building (release)"
cargo build --release --workspace --bins --quiet
# Benchmarks print their own figures; the libraries' logs only on warnings.
export RUST_LOG=${RUST_LOG:-warn}
exec "$root/target/release/adbench" "$@"
