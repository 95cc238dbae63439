#!/usr/bin/env bash
# Fuzzes the parsers of the wire crate with cargo-fuzz (libFuzzer): the
# impression line parser and its dead letters, the SPEND decoder, the push
# decoder and the catalog parser. The targets link adspend-wire alone
# (docs/FUZZING.md says what each target checks).
#
#   bash scripts/fuzz.sh [--seconds N] [target...]   N seconds per target (default 60)
#   bash scripts/fuzz.sh --ci [target...]            20 seconds per target, unoptimized build
#   bash scripts/fuzz.sh --merge [target...]         fold what runs found into the committed corpus
#
# Installs cargo-fuzz into .tools/bin if it is missing, builds every target
# into fuzz/target (not the workspace's target/), then runs the targets one
# after the other. Each run reads the committed seeds in fuzz/corpus/<target>
# and keeps what it finds new in fuzz/target/corpus/<target>; a crash is saved
# under fuzz/artifacts/<target>/ and makes the script exit 1. --ci builds
# without optimization (a first build costs a third less; runs are 10-25
# times slower, enough to replay the corpus and explore a little) so that
# it stays under 8 minutes from a fresh clone.
# --merge shrinks
# fuzz/target/corpus/<target> with `cargo fuzz cmin`, then adds to
# fuzz/corpus/<target> the fewest inputs that reach the edges it lacks.
# ADSPEND_FUZZ_SANITIZER=address builds with AddressSanitizer (default: none;
# the code under test is safe Rust, and none runs about twice as fast).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"

all=(limiter_line limiter_binary spend_decode pacer_push catalog_parse)
seconds=60
merge=0
profile=()
build_kind=optimized
targets=()
while [ $# -gt 0 ]; do
  case "$1" in
    --seconds) seconds=${2:-}; shift 2 || shift ;;
    --seconds=*) seconds=${1#*=}; shift ;;
    --ci) seconds=20; profile=(--dev); build_kind=unoptimized; shift ;;
    --merge) merge=1; shift ;;
    -h | --help) sed -n '2,/^set -e/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    -*) echo "fuzz: unknown option $1 (--seconds N, --ci, --merge, target names)" >&2; exit 2 ;;
    *) targets+=("$1"); shift ;;
  esac
done
case "$seconds" in '' | *[!0-9]* | 0) echo "fuzz: --seconds needs a whole number above 0, got '$seconds'" >&2; exit 2 ;; esac
[ ${#targets[@]} -gt 0 ] || targets=("${all[@]}")
for t in "${targets[@]}"; do
  [ -f "fuzz/fuzz_targets/$t.rs" ] || { echo "fuzz: no target $t (targets: ${all[*]})" >&2; exit 2; }
done
sanitizer=${ADSPEND_FUZZ_SANITIZER:-none}
start=$(date +%s)

# cargo-fuzz passes nightly-only flags; the toolchain the repository pins
# (stable) accepts them with RUSTC_BOOTSTRAP.
export RUSTC_BOOTSTRAP=1
export PATH="$root/.tools/bin:$PATH"
cargo_fuzz_version=0.13.2
if ! command -v cargo-fuzz >/dev/null 2>&1; then
  echo "fuzz: installing cargo-fuzz $cargo_fuzz_version into .tools/bin (cargo install, about a minute)"
  set +e
  cargo install --locked --version "$cargo_fuzz_version" --root "$root/.tools" cargo-fuzz 2>&1 |
    grep --line-buffered -E '^\s*(Compiling|Installing|Installed|Replacing|error|warning: )'
  set -e
  command -v cargo-fuzz >/dev/null 2>&1 || { echo "fuzz: installing cargo-fuzz failed" >&2; exit 1; }
fi
if [ "$merge" = 1 ]; then
  echo "fuzz: $(cargo-fuzz --version), merging found inputs into fuzz/corpus: ${targets[*]}"
else
  echo "fuzz: $(cargo-fuzz --version), sanitizer $sanitizer, $build_kind build, ${seconds}s per target: ${targets[*]}"
fi

# A first build compiles every dependency with coverage instrumentation
# (4 to 6 minutes on two cores); later builds only what changed.
echo "fuzz: building the targets into fuzz/target"
build_start=$(date +%s)
set +e
cargo fuzz build "${profile[@]}" --sanitizer "$sanitizer" 2>&1 |
  grep --line-buffered -vE '^\s*(Downloaded|Downloading|Locking|Adding|Updating) '
build_rc=${PIPESTATUS[0]}
set -e
if [ "$build_rc" -ne 0 ]; then
  echo "fuzz: build failed" >&2
  exit 1
fi
echo "fuzz: build took $(($(date +%s) - build_start))s"

if [ "$merge" = 1 ]; then
  for t in "${targets[@]}"; do
    found="fuzz/target/corpus/$t"
    if [ -z "$(ls -A "$found" 2>/dev/null)" ]; then
      echo "fuzz: $t: nothing found to merge ($found is empty)"
      continue
    fi
    echo "fuzz: $t: cargo fuzz cmin $found ($(find "$found" -type f | wc -l) inputs)"
    cargo fuzz cmin --sanitizer "$sanitizer" "$t" "$found" 2>&1 | grep --line-buffered -E 'MERGE-OUTER|ERROR|panicked' || true
    before=$(find "fuzz/corpus/$t" -type f | wc -l)
    # Edges only (no hit counts), smallest covering set: the committed
    # corpus stays small; the full one stays in fuzz/target/corpus.
    cargo fuzz run --sanitizer "$sanitizer" "$t" "fuzz/corpus/$t" "$found" -- \
      -set_cover_merge=1 -use_counters=0 2>&1 |
      grep --line-buffered -E 'MERGE-OUTER|ERROR|panicked' || true
    echo "fuzz: $t: fuzz/corpus/$t: $before -> $(find "fuzz/corpus/$t" -type f | wc -l) inputs, $(find "fuzz/corpus/$t" -type f -printf '%s\n' | awk '{s += $1} END {print s}') bytes"
  done
  exit 0
fi

# libFuzzer's final statistics: "stat::<name>:   <value>".
stat_of() {
  awk -F: -v name="$1" '$1 == "stat" && $3 == name {gsub(/ /, "", $4); v = $4} END {print v}' "$2"
}

logs=$(mktemp -d)
trap 'rm -rf "$logs"' EXIT
status=0
rows=()
for t in "${targets[@]}"; do
  found="fuzz/target/corpus/$t"
  mkdir -p "$found" "fuzz/artifacts/$t" "fuzz/corpus/$t"
  dict=()
  [ -f "fuzz/dicts/$t.dict" ] && dict=("-dict=fuzz/dicts/$t.dict")
  log="$logs/$t.log"
  echo "fuzz: $t: ${seconds}s (seeds fuzz/corpus/$t, new inputs into $found)"
  set +e
  # New inputs go to the first corpus directory only; -timeout makes an input
  # that takes over 10 s a finding; the pulse lines are the progress.
  cargo fuzz run "${profile[@]}" --sanitizer "$sanitizer" "$t" "$found" "fuzz/corpus/$t" -- \
    -max_total_time="$seconds" -timeout=10 -print_final_stats=1 "${dict[@]}" 2>&1 |
    tee "$log" | grep --line-buffered -E 'pulse|DONE|^==[0-9]+==|SUMMARY|Test unit written' |
    sed -u "s/^/fuzz: $t: /"
  rc=${PIPESTATUS[0]}
  set -e
  execs=$(stat_of number_of_executed_units "$log")
  rate=$(stat_of average_exec_per_sec "$log")
  corpus=$(awk '{for (i = 1; i < NF; i++) if ($i == "corp:") c = $(i + 1)} END {print c}' "$log")
  findings=$(grep -c 'Test unit written to' "$log" || true)
  if [ "$rc" -ne 0 ]; then
    status=1
    if [ "$findings" -gt 0 ]; then
      grep -A3 'panicked' "$log" | head -8 | sed "s/^/fuzz: $t: /" || true
    else
      findings="run failed (exit $rc)"
      tail -n 15 "$log" | sed "s/^/fuzz: $t: /"
    fi
    for a in $(grep -Eo 'Test unit written to [^ ]+' "$log" | awk '{print $5}'); do
      echo "fuzz: $t: reproduce: RUSTC_BOOTSTRAP=1 PATH=.tools/bin:\$PATH cargo fuzz run ${profile[*]} --sanitizer $sanitizer $t ${a#"$root"/}"
    done
  fi
  rows+=("$(printf '%-14s %8s %12s %8s %12s  %s' "$t" "$seconds" "${execs:-?}" "${rate:-?}" "${corpus:-?}" "$findings")")
done

echo "fuzz: $(printf '%-14s %8s %12s %8s %12s  %s' target seconds executions exec/s corpus findings)"
for row in "${rows[@]}"; do echo "fuzz: $row"; done
echo "fuzz: took $(($(date +%s) - start))s in all"
if [ "$status" -ne 0 ]; then
  echo "fuzz: FAILED: a target crashed or could not run (inputs under fuzz/artifacts/)" >&2
fi
exit "$status"
