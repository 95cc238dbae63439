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
echo "bench: building (release; a few minutes on 2 cores the first time, each crate named as it compiles)"
mkdir -p target
build_log="$root/target/bench-build.log"
set +e
cargo build --release -p adspend-limiter -p adspend-aggregator -p adspend-pacer -p adspend-bench --bins 2>&1 | tee "$build_log" | grep --line-buffered -E '^\s*(Compiling|Finished)'
status=${PIPESTATUS[0]}
set -e
if [ "$status" -ne 0 ]; then
  tail -40 "$build_log" >&2
  echo "bench: the build failed (whole output in $build_log)" >&2
  exit 1
fi
# Benchmarks print their own figures; the libraries' logs only on warnings.
export RUST_LOG=${RUST_LOG:-warn}
exec "$root/target/release/adbench" "$@"
