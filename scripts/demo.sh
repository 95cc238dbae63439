#!/usr/bin/env bash
# The local pipeline on embedded defaults: NATS + limiter + aggregator + pacer
# on this machine (file:// snapshots, checkpoint records in the data dir),
# simulated ad servers against it, and the pacer's per-limit spend printed
# next to the budgets and the ground truth.
#
# By default the ad servers serve by spend leases (closed loop, `adsim
# serve --mode leases`): a day of traffic compressed into DEMO_DAY, each
# server leasing ahead per ad (POST /v1/leases, DEMO_LEASE_TTL_MS, 3 s by
# default) and serving only what its leases pay for, so no limit ends over
# its budget; the pacer holds an expired lease's unreported spend for
# DEMO_LEASE_GRACE_MS (3 s: the demo's impressions arrive at once).
#
#   DEMO_DAY=60s DEMO_PEAK_RATE=2000 scripts/demo.sh
#
# DEMO_SERVE=decisions has them ask POST /v1/decisions instead and serve an
# ad only when it is servable, with probability equal to its multiplier.
#
# DEMO_MODE=open publishes regardless of budgets instead (`adsim run`, the
# throughput demo): DEMO_EVENTS=200000 DEMO_BATCH=100 DEMO_MODE=open scripts/demo.sh
#
# NATS runs with the least-privilege users of deploy/nats-auth.conf over TLS
# (scripts/nats-auth.sh writes a demo CA, passwords and the server config
# into demo-out/nats-auth): each service logs in as its own user, and the
# simulated ad servers as `adserver`, which may publish impressions and
# nothing else (docs/SECURITY.md).
#
# Only what the demo runs is built: the three services, adsim and adcheck,
# unoptimized (the `demo` profile; a few minutes the first time, cargo's
# progress shown). DEMO_PROFILE=release builds them optimized (about ten
# minutes the first time on 2 cores) for figures that need the speed.
#
# Services keep running for the dashboard when started from a terminal
# (Ctrl-C stops them); otherwise the script stops them and exits.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
events=${DEMO_EVENTS:-200000}
batch=${DEMO_BATCH:-100}
mode=${DEMO_MODE:-closed}
serve=${DEMO_SERVE:-leases}
lease_ttl_ms=${DEMO_LEASE_TTL_MS:-3000}
export ADSPEND_PACER_LEASE_GRACE_MS=${DEMO_LEASE_GRACE_MS:-3000}
day=${DEMO_DAY:-60s}
peak_rate=${DEMO_PEAK_RATE:-2000}
out="$root/demo-out"
profile=${DEMO_PROFILE:-demo}

bash scripts/install-deps.sh run
echo "demo: building the services, adsim and adcheck (profile $profile; the first build takes a few minutes)"
build_start=$(date +%s)
# Every line of cargo's shown, each crate numbered with the time so far; a
# crate that takes long (the services' own) gets a line every
# 30 s, so no step is silent.
cargo build --profile "$profile" \
  -p adspend-limiter -p adspend-aggregator -p adspend-pacer -p adspend-sim \
  --bin limiter --bin aggregator --bin pacer --bin adsim --bin adcheck 2>&1 |
  while true; do
    if IFS= read -r -t 30 line; then
      case $line in
        *Compiling*) n=$((${n:-0} + 1)); echo "demo: build [$n, $(( $(date +%s) - build_start ))s] ${line#"${line%%[! ]*}"}" ;;
        *) echo "$line" ;;
      esac
    elif [ $? -gt 128 ]; then
      echo "demo: build still running ($(( $(date +%s) - build_start ))s)"
    else
      break
    fi
  done
echo "demo: built in $(( $(date +%s) - build_start ))s"
bin="${CARGO_TARGET_DIR:-$root/target}/$profile"

for port in 4222 8222 8080 9101 9102 9103; do
  if (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then
    echo "demo: port $port is in use; stop whatever listens there (an earlier demo?) and retry" >&2
    exit 1
  fi
done

rm -rf "$out"
mkdir -p "$out"
pids=()
nats_pid=
# The services first (each finishes its work in hand), NATS last.
cleanup() {
  for pid in "${pids[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  for pid in "${pids[@]}"; do wait "$pid" 2>/dev/null || true; done
  if [ -n "$nats_pid" ]; then
    kill -TERM "$nats_pid" 2>/dev/null || true
    wait "$nats_pid" 2>/dev/null || true
  fi
}
trap cleanup EXIT

# NATS with accounts, users and TLS; the JetStream store inside demo-out.
auth="$out/nats-auth"
ADSPEND_NATS_PORT=4222 ADSPEND_NATS_MONITOR_PORT=8222 bash scripts/nats-auth.sh "$auth" >/dev/null
"$root/.tools/bin/nats-server" -c "$auth/nats-server.conf" >"$out/nats.log" 2>&1 &
nats_pid=$!
for _ in $(seq 100); do
  curl -sf http://127.0.0.1:8222/healthz >/dev/null 2>&1 && break
  sleep 0.1
done
curl -sf http://127.0.0.1:8222/healthz >/dev/null || { echo "demo: nats-server did not start:" >&2; tail -5 "$out/nats.log" >&2; exit 1; }
echo "demo: NATS with a user per role over TLS (secrets in $auth, never commit them)"
# `as_role ROLE COMMAND...`: COMMAND with that role's NATS settings, in
# place of the (sub)shell that runs it: call it with `&` or inside `( )`, so
# that a background service's pid is the service's own.
as_role() {
  local role=$1
  shift
  set -a
  . "$auth/$role.env"
  set +a
  exec "$@"
}

"$bin/adsim" catalog --out "$out/catalog.json" --ads 1000 --seed 7
export ADSPEND_CATALOG="$out/catalog.json"
export ADSPEND_CHECKPOINT_INTERVAL_MS=2000
as_role aggregator env ADSPEND_DATA_DIR="$out/aggregator" "$bin/aggregator" >"$out/aggregator.log" 2>&1 &
pids+=($!)
as_role limiter "$bin/limiter" >"$out/limiter.log" 2>&1 &
pids+=($!)
as_role pacer "$bin/pacer" >"$out/pacer.log" 2>&1 &
pids+=($!)
for _ in $(seq 100); do
  curl -sf http://127.0.0.1:8080/healthz >/dev/null 2>&1 && break
  sleep 0.1
done
# The ad servers' user may not create streams: IMPRESSIONS is the limiter's.
for _ in $(seq 100); do
  curl -sf 'http://127.0.0.1:8222/jsz?accounts=true&streams=true' 2>/dev/null | tr -d ' \n' | grep -q '"name":"IMPRESSIONS"' && break
  sleep 0.1
done
if ! curl -sf http://127.0.0.1:8080/healthz >/dev/null; then
  echo "demo: the services did not start:" >&2
  tail -n 3 "$out"/limiter.log "$out"/aggregator.log "$out"/pacer.log >&2
  exit 1
fi

start_ns=$(date +%s%N)
if [ "$mode" = open ]; then
  echo "demo: publishing $events impressions (5% duplicates, 1% bad, $batch per message), regardless of budgets"
  (as_role adserver "$bin/adsim" run --catalog "$out/catalog.json" --truth-out "$out/truth.json" \
    --events "$events" --duplicate-rate 0.05 --bad-rate 0.01 --batch "$batch" --seed 7)
else
  echo "demo: ad servers asking the pacer ($serve) before they serve, a day compressed into $day (peak $peak_rate requests/s)"
  (as_role adserver "$bin/adsim" serve --catalog "$out/catalog.json" --truth-out "$out/truth.json" \
    --pacer-url http://127.0.0.1:8080 --day "$day" --peak-rate "$peak_rate" --mode "$serve" \
    --lease-ttl-ms "$lease_ttl_ms" --seed 7)
fi
"$bin/adcheck" --truth "$out/truth.json" --timeout 120 --show 15
end_ns=$(date +%s%N)
python3 - "$out/truth.json" "$start_ns" "$end_ns" <<'PY'
import json, sys
stats = json.load(open(sys.argv[1]))["stats"]
secs = (int(sys.argv[3]) - int(sys.argv[2])) / 1e9
print(f"demo: {stats['events_sent']} events published, pipeline equal to the truth after {secs:.1f}s "
      f"({stats['events_sent'] / secs:,.0f} events/s end to end)")
PY
echo "demo: spend against budgets (the 15 limits with the most spend for their budget):"
python3 - <<'PY'
import json, urllib.request
limits, after = [], None
while True:
    url = "http://127.0.0.1:8080/v1/limits?limit=1000" + (f"&after={after}" if after else "")
    page = json.load(urllib.request.urlopen(url))
    limits += page["limits"]
    after = page.get("next")
    if not after:
        break
limits.sort(key=lambda l: l["spend_micros"] / l["budget_micros"], reverse=True)
print(f"{'limit':<14} {'period':<9} {'budget':>12} {'spend':>12} {'% of budget':>11} {'over by':>9} {'bound':>9}  state")
for l in limits[:15]:
    over = max(0, l["spend_micros"] - l["budget_micros"])
    state = "exhausted" if l["exhausted"] else f"multiplier {l['pacing']['multiplier']:.2f}"
    print(f"{l['limit_id']:<14} {l['period']:<9} {l['budget_micros']/1e6:>12.2f} {l['spend_micros']/1e6:>12.2f} "
          f"{100*l['spend_micros']/l['budget_micros']:>10.1f}% {over/1e6:>9.2f} {l['overspend_bound_micros']/1e6:>9.2f}  {state}")
exhausted = sum(l["exhausted"] for l in limits)
over = [l for l in limits if l["spend_micros"] > l["budget_micros"]]
worst = max((100 * (l["spend_micros"] - l["budget_micros"]) / l["budget_micros"] for l in over), default=0.0)
print(f"demo: {len(limits)} limits, {exhausted} exhausted (stopped by the pacer), "
      f"{len(over)} over budget (worst by {worst:.2f}% of its budget); amounts in currency units")
PY
echo "demo: dead letters by reason:"
curl -s http://127.0.0.1:9101/metrics | grep '^adspend_rejected_total' || true
echo "demo: pacer API and dashboard at http://127.0.0.1:8080/  (logs in $out)"
if [ -t 0 ]; then
  echo "demo: services keep running; Ctrl-C stops them"
  wait
fi
