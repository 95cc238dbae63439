#!/usr/bin/env bash
# adspend on docker-compose (deploy/docker-compose.yml, docs/CLUSTER.md).
#
#   scripts/cluster.sh up [CATALOG]   install what is missing, build the images, start, load CATALOG
#                                     (default deploy/catalog.example.json) into etcd; returns when
#                                     pacer1 answers https://127.0.0.1:8080/healthz
#   scripts/cluster.sh down           stop the cluster and remove its containers, networks and volumes
#   scripts/cluster.sh images         build the service binaries and every image (no registry)
#   scripts/cluster.sh secrets [--new]  generate the CA, certificates and passwords into deploy/.secrets
#                                     (git-ignored; `images` and `start` do it when missing)
#   scripts/cluster.sh start [CATALOG]  `up` without installing or building (the images must exist)
#   scripts/cluster.sh status         containers, partition owners in etcd, the pacer's shards
#   scripts/cluster.sh logs [SERVICE...]  the last lines of the services' logs
#   scripts/cluster.sh scale N        run aggregator1..aggregatorN (1..4); the others stop cleanly
#   scripts/cluster.sh demo [EVENTS]  publish EVENTS impressions (10% duplicates) with adsim for the
#                                     loaded catalog, then compare the pacer with the truth (adcheck)
#   scripts/cluster.sh freshness [RATE] [SECONDS]  publish RATE events/s (default 45000) for SECONDS
#                                     (default 60) with adsim; print pacer1's freshness p50/p90/p99
#   scripts/cluster.sh chaos --faults N --seed S  the random fault campaign against the running
#                                     cluster (docs/CLUSTER.md); last line: chaos: N faults, M mismatches
#   scripts/cluster.sh failover [--runs N]  N times (default 10): kill an aggregator and pause another
#                                     under traffic; print each failover's timeline and the time from
#                                     the last publish to exact totals
#
# ADSPEND_CLUSTER_PROJECT names the compose project (default adspend).
# ADSPEND_AGGREGATOR1_PARTITIONS=all runs aggregator1 as a single-owner aggregator.
# NATS and etcd take TLS clients with credentials only: deploy/.secrets/<role>.env holds a
# role's ADSPEND_NATS_* for a client on the host (adserver: publish impressions; auditor: read them).
# The pacers' API is HTTPS with bearer tokens: deploy/.secrets/pacer-client.env holds
# ADSPEND_PACER_URL, ADSPEND_PACER_TLS_CA and ADSPEND_PACER_READ_TOKEN for a client on the host.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
project=${ADSPEND_CLUSTER_PROJECT:-adspend}
compose_file="$root/deploy/docker-compose.yml"
stage="$root/target/cluster-images"
static_target=x86_64-unknown-linux-gnu
target_dir=${CARGO_TARGET_DIR:-$root/target}
bin="$target_dir/$static_target/release"
images=(adspend/services:dev adspend/nats:dev adspend/etcd:dev adspend/s3:dev adspend/prometheus:dev)
infra=(nats1 nats2 nats3 etcd1 etcd2 etcd3 s3)
bucket=adspend-snapshots
catalog_key=/adspend/catalog
secrets="$root/deploy/.secrets"
nats_roles=(adserver limiter aggregator pacer auditor)
# What deploy/.secrets holds; a directory made by an older version is made anew.
secrets_version=3

# shellcheck source=scripts/lib/tls.sh
source "$root/scripts/lib/tls.sh"
# shellcheck source=scripts/lib/compose.sh
source "$root/scripts/lib/compose.sh"

say() { echo "cluster: $*"; }
die() { echo "cluster: error: $*" >&2; exit 1; }
compose() { docker-compose -f "$compose_file" -p "$project" "$@"; }
container() { compose ps -q "$1"; }
elapsed() { echo "$(( $(date +%s) - $1 ))s"; }

# Copy an executable (to its own path, or to PATH_IN_IMAGE) and the shared
# libraries ldd names, under the same paths: copy_with_libs EXE ROOTFS [PATH_IN_IMAGE].
copy_with_libs() {
  local exe=$1 dest=$2 lib
  install -D -m 0755 "$exe" "$dest${3:-$exe}"
  for lib in $(ldd "$exe" | grep -Eo '/[^ ]+'); do
    install -D -m 0755 "$(readlink -f "$lib")" "$dest$lib"
  done
}

fresh_rootfs() {
  rm -rf "$stage/$1"
  mkdir -p "$stage/$1/rootfs/data" "$stage/$1/rootfs/tmp"
  chmod 1777 "$stage/$1/rootfs/tmp"
  echo "$stage/$1/rootfs"
}

build_image() {
  local name=$1 started
  started=$(date +%s)
  say "docker build adspend/$name:dev"
  docker build -t "adspend/$name:dev" -f "$root/deploy/images/$name.Dockerfile" "$stage/$name" | sed 's/^/  /'
  say "image adspend/$name:dev built in $(elapsed "$started")"
}

cmd_images() {
  require_docker
  cmd_secrets
  local started rootfs
  started=$(date +%s)
  say "cargo build --release (static glibc) of limiter, aggregator, pacer, adspend-probe"
  RUSTFLAGS="-C target-feature=+crt-static" cargo build --release --target "$static_target" \
    -p adspend-limiter -p adspend-aggregator -p adspend-pacer -p adspend-common --bins
  for b in limiter aggregator pacer adspend-probe; do
    file "$bin/$b" | grep -q 'static' || die "$bin/$b is not statically linked: $(file -b "$bin/$b")"
  done
  say "binaries built and static ($(elapsed "$started"))"

  rootfs=$(fresh_rootfs services)
  mkdir -p "$rootfs/usr/local/bin" "$rootfs/etc/ssl/certs"
  # Line tables stay in target/ for backtraces; the images carry symbols only.
  for b in limiter aggregator pacer adspend-probe; do
    objcopy --strip-debug "$bin/$b" "$rootfs/usr/local/bin/$b"
  done
  cp /etc/ssl/certs/ca-certificates.crt "$rootfs/etc/ssl/certs/"
  build_image services

  local nats_server
  [ -x "$root/.tools/venv/bin/nats-server" ] || die "$root/.tools/venv/bin/nats-server is missing (bash scripts/install-deps.sh cluster)"
  nats_server=$(readlink -f "$root/.tools/venv/bin/nats-server")
  file "$nats_server" | grep -q 'statically linked' || die "$nats_server is not the static nats-server (bash scripts/install-deps.sh cluster)"
  rootfs=$(fresh_rootfs nats)
  install -m 0755 "$nats_server" "$rootfs/nats-server"
  install -m 0755 "$rootfs/../../services/rootfs/usr/local/bin/adspend-probe" "$rootfs/adspend-probe"
  build_image nats

  rootfs=$(fresh_rootfs etcd)
  copy_with_libs /usr/bin/etcd "$rootfs"
  copy_with_libs /usr/bin/etcdctl "$rootfs"
  install -m 0755 "$stage/services/rootfs/usr/local/bin/adspend-probe" "$rootfs/adspend-probe"
  build_image etcd

  [ -x "$root/.tools/bin/s3s-fs" ] || die "$root/.tools/bin/s3s-fs is missing (bash scripts/install-deps.sh cluster)"
  rootfs=$(fresh_rootfs s3)
  copy_with_libs "$root/.tools/bin/s3s-fs" "$rootfs" /usr/local/bin/s3s-fs
  # The bucket is a directory of the store's root; a new volume starts as a
  # copy of it. The aggregators create it again if it ever goes.
  mkdir -p "$rootfs/data/$bucket"
  install -D -m 0755 "$stage/services/rootfs/usr/local/bin/adspend-probe" "$rootfs/usr/local/bin/adspend-probe"
  build_image s3

  [ -x /usr/bin/prometheus ] || die "/usr/bin/prometheus is missing (bash scripts/install-deps.sh cluster)"
  rootfs=$(fresh_rootfs prometheus)
  copy_with_libs /usr/bin/prometheus "$rootfs"
  install -D -m 0755 "$stage/services/rootfs/usr/local/bin/adspend-probe" "$rootfs/usr/local/bin/adspend-probe"
  build_image prometheus
  say "images ready in $(elapsed "$started"): ${images[*]}"
}

# The cluster's CA, certificates and NATS passwords, made once into deploy/.secrets
# (git-ignored, mode 700; --new replaces them). Nothing secret goes into an image.
cmd_secrets() {
  if [ "$(cat "$secrets/.complete" 2>/dev/null)" = "$secrets_version" ] && [ "${1:-}" != --new ]; then
    return
  fi
  command -v openssl >/dev/null || die "openssl is required"
  local python="$root/.tools/venv/bin/python" role upper password hash
  "$python" -c 'import bcrypt' 2>/dev/null || die "python bcrypt is missing (bash scripts/install-deps.sh cluster)"
  say "generating the CA, certificates and passwords into $secrets"
  rm -rf "$secrets"
  (umask 077 && mkdir -p "$secrets")
  new_ca "adspend cluster CA"
  # Routes dial each other with it too (clientAuth).
  issue nats-server serverAuth,clientAuth "DNS:nats1,DNS:nats2,DNS:nats3,DNS:localhost,IP:127.0.0.1"
  # etcd's gateway dials its own gRPC port with the server certificate.
  issue etcd-server serverAuth,clientAuth "DNS:etcd1,DNS:etcd2,DNS:etcd3,DNS:localhost,IP:127.0.0.1"
  for role in limiter aggregator pacer admin; do
    issue "etcd-$role" clientAuth
  done
  # The pacers' API (HTTPS); the host reaches pacer1 as 127.0.0.1.
  issue pacer-server serverAuth "DNS:pacer1,DNS:pacer2,DNS:localhost,IP:127.0.0.1"
  rm -f "$secrets/ca.srl"
  {
    echo "# Generated by scripts/cluster.sh secrets: the NATS servers' TLS paths and password hashes; secret."
    echo 'ADSPEND_NATS_TLS_SERVER_CA: "/secrets/ca.pem"'
    echo 'ADSPEND_NATS_TLS_SERVER_CERT: "/secrets/nats-server.pem"'
    echo 'ADSPEND_NATS_TLS_SERVER_KEY: "/secrets/nats-server-key.pem"'
    for role in "${nats_roles[@]}"; do
      password=$(openssl rand -hex 24)
      upper=$(echo "$role" | tr '[:lower:]' '[:upper:]')
      hash=$(printf %s "$password" | bcrypt_hash "$python")
      echo "ADSPEND_NATS_${upper}_PASSWORD: \"$hash\""
      # A client on the host (tests, adsim, an ad server of your own).
      printf 'ADSPEND_NATS_URL=nats://127.0.0.1:4222\nADSPEND_NATS_USER=%s\nADSPEND_NATS_PASSWORD=%s\nADSPEND_NATS_TLS_CA=%s\n' \
        "$role" "$password" "$secrets/ca.pem" >"$secrets/$role.env"
      case $role in
        limiter | aggregator | pacer)
          printf 'ADSPEND_NATS_USER=%s\nADSPEND_NATS_PASSWORD=%s\nADSPEND_NATS_TLS_CA=/secrets/ca.pem\nADSPEND_ETCD_TLS_CA=/secrets/ca.pem\nADSPEND_ETCD_TLS_CERT=/secrets/etcd-%s.pem\nADSPEND_ETCD_TLS_KEY=/secrets/etcd-%s-key.pem\n' \
            "$role" "$password" "$role" "$role" >"$secrets/$role.service.env"
          ;;
      esac
    done
  } >"$secrets/nats-users.conf"
  nats_config
  # The pacers' bearer tokens: one of the read scope, one of the decide scope.
  local read_token decide_token
  read_token=$(openssl rand -hex 24)
  decide_token=$(openssl rand -hex 24)
  printf 'ADSPEND_PACER_TLS_CERT=/secrets/pacer-server.pem\nADSPEND_PACER_TLS_KEY=/secrets/pacer-server-key.pem\nADSPEND_PACER_READ_TOKENS=%s\nADSPEND_PACER_DECIDE_TOKENS=%s\n' \
    "$read_token" "$decide_token" >>"$secrets/pacer.service.env"
  # A client of pacer1's API on the host (../shared/CONTRACT.md, "Cluster").
  printf 'ADSPEND_PACER_URL=https://127.0.0.1:8080\nADSPEND_PACER_TLS_CA=%s\nADSPEND_PACER_READ_TOKEN=%s\nADSPEND_PACER_DECIDE_TOKEN=%s\n' \
    "$secrets/ca.pem" "$read_token" "$decide_token" >"$secrets/pacer-client.env"
  echo "$secrets_version" >"$secrets/.complete"
}

# The NATS servers' config: the generated hashes and TLS paths, then the
# cluster and authorization files as they are now, so a grant added to
# deploy/nats-auth.conf reaches the next `start` (or a reload) without new secrets.
nats_config() {
  {
    echo "# Generated by scripts/cluster.sh from $secrets/nats-users.conf, deploy/nats-cluster.conf and deploy/nats-auth.conf; secret."
    cat "$secrets/nats-users.conf" "$root/deploy/nats-cluster.conf" "$root/deploy/nats-auth.conf"
  } >"$secrets/nats.conf.new"
  mv "$secrets/nats.conf.new" "$secrets/nats.conf"
}

# GET pacer1's API at PATH as a host client does (deploy/.secrets/pacer-client.env:
# its URL, CA and read token; plain http://127.0.0.1:8080 without that file).
pacer_get() {
  local env="$secrets/pacer-client.env" url=http://127.0.0.1:8080 ca="" token=""
  if [ -f "$env" ]; then
    url=$(sed -n 's/^ADSPEND_PACER_URL=//p' "$env")
    ca=$(sed -n 's/^ADSPEND_PACER_TLS_CA=//p' "$env")
    token=$(sed -n 's/^ADSPEND_PACER_READ_TOKEN=//p' "$env")
  fi
  if [ -z "$token" ]; then
    curl -sf ${ca:+--cacert "$ca"} "$url$1"
  else
    # The token goes in on stdin, not on the command line.
    curl -sf ${ca:+--cacert "$ca"} -H @- "$url$1" <<<"Authorization: Bearer $token"
  fi
}

# pacer1's API URL as the host reaches it.
pacer_url() {
  sed -n 's/^ADSPEND_PACER_URL=//p' "$secrets/pacer-client.env" 2>/dev/null | grep . || echo http://127.0.0.1:8080
}

# The truth of every demo run since this project's `start`.
demo_truth() { echo "$root/target/cluster-demo/$project-truth.json"; }

port_in_use() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

cmd_start() {
  require_docker
  local catalog=${1:-$root/deploy/catalog.example.json} started img
  [ -f "$catalog" ] || die "catalog $catalog does not exist"
  python3 -c 'import json, sys; json.load(open(sys.argv[1]))' "$catalog" 2>/dev/null || die "catalog $catalog is not valid JSON"
  for img in "${images[@]}"; do
    docker image inspect "$img" >/dev/null 2>&1 || die "image $img is missing: run 'bash scripts/cluster.sh images' (or 'up')"
  done
  cmd_secrets
  nats_config
  if [ -z "$(compose ps -q 2>/dev/null)" ]; then
    for port in 4222 8080 9090; do
      port_in_use "$port" && die "127.0.0.1:$port is in use (another cluster, project '$project'? a demo?); stop it first"
    done
  fi
  started=$(date +%s)
  rm -f "$(demo_truth)"
  say "starting ${infra[*]} (project $project)"
  compose up -d "${infra[@]}"
  wait_healthy 180 "${infra[@]}"
  say "loading catalog $catalog into etcd at $catalog_key ($(wc -c <"$catalog") bytes)"
  docker exec -i "$(container etcd1)" etcdctl put "$catalog_key" <"$catalog" >/dev/null \
    || die "could not write the catalog into etcd"
  say "starting limiters, aggregators and pacers"
  compose up -d
  wait_healthy 180 limiter1 limiter2 aggregator1 aggregator2 aggregator3 pacer1 pacer2 prometheus
  local i
  for i in $(seq 120); do
    pacer_get /healthz >/dev/null 2>&1 && break
    sleep 0.5
  done
  pacer_get /healthz >/dev/null || die "pacer1 does not answer $(pacer_url)/healthz"
  say "cluster up in $(elapsed "$started"): NATS nats://127.0.0.1:4222, pacer $(pacer_url) (CA, read token: $secrets/pacer-client.env), Prometheus http://127.0.0.1:9090"
}

cmd_down() {
  require_docker
  say "stopping project $project and removing its volumes"
  rm -f "$(demo_truth)"
  local err
  if ! err=$(compose --profile scale down -v --remove-orphans --timeout 10 2>&1); then
    echo "$err" >&2
    # Docker 20.10 now and then keeps a removed container's endpoint on a
    # network; the containers are gone, the network is reused by the next up.
    grep -q 'active endpoints' <<<"$err" || die "docker-compose down failed"
    say "a network kept a stale endpoint (Docker); removing the volumes by label"
    docker volume ls -q --filter "label=com.docker.compose.project=$project" | xargs -r docker volume rm >/dev/null
  fi
}

cmd_status() {
  require_docker
  compose --profile scale ps
  local etcd
  etcd=$(container etcd1)
  if [ -n "$etcd" ]; then
    echo "members:"
    docker exec "$etcd" etcdctl get --prefix /adspend/members/ --keys-only | sed '/^$/d; s/^/  /'
    echo "partition owners:"
    docker exec "$etcd" etcdctl get --prefix /adspend/partitions/ \
      | paste - - | sed 's|/adspend/partitions/||; s|/owner||; s/^/  p/' | sort -V | paste - - - - | column -t
  fi
  echo "pacer shards:"
  pacer_get /v1/shards | python3 -c '
import json, sys
for s in sorted(json.load(sys.stdin)["shards"], key=lambda s: int(s["shard"][1:])):
    print("  %-4s epoch %-6s seq %-10s lag_ms %s" % (s["shard"], s.get("epoch"), s.get("seq"), s.get("lag_ms")))' \
    || echo "  (pacer not answering)"
}

cmd_scale() {
  require_docker
  local n=${1:-} i up=() down=()
  [[ "$n" =~ ^[1-4]$ ]] || die "scale takes a number of aggregators from 1 to 4"
  for i in 1 2 3 4; do
    if [ "$i" -le "$n" ]; then up+=("aggregator$i"); else down+=("aggregator$i"); fi
  done
  say "running ${up[*]}"
  compose --profile scale up -d --no-recreate "${up[@]}"
  if [ ${#down[@]} -gt 0 ]; then
    say "stopping ${down[*]} (SIGTERM: they hand their partitions over)"
    compose --profile scale stop --timeout 30 "${down[@]}"
  fi
  wait_healthy 120 "${up[@]}"
}

# The pacer holds everything published since `start`: add a run's truth to
# the project's, which `demo` compares the pacer with.
add_to_demo_truth() {
  python3 - "$1" "$(demo_truth)" <<'PY'
import json, os, sys
run = json.load(open(sys.argv[1]))
path = sys.argv[2]
if os.path.exists(path):
    total = json.load(open(path))
    for limit, t in run["limits"].items():
        acc = total["limits"].setdefault(limit, {"lifetime_micros": 0})
        acc["lifetime_micros"] += t["lifetime_micros"]
        for day, micros in t.get("daily", {}).items():
            acc.setdefault("daily", {})[day] = acc.get("daily", {}).get(day, 0) + micros
    run["limits"] = total["limits"]
json.dump(run, open(path, "w"))
PY
}

cmd_demo() {
  require_docker
  local events=${1:-100000} out="$root/target/cluster-demo" started
  [ -n "$(container pacer1)" ] || die "the cluster is not running: bash scripts/cluster.sh up"
  # A debug build shares its dependencies with the test suite's, and
  # publishes far faster than the cluster on one host absorbs.
  say "building adsim and adcheck (debug)"
  cargo build -p adspend-sim --bin adsim --bin adcheck
  local tools="$target_dir/debug"
  mkdir -p "$out"
  docker exec "$(container etcd1)" etcdctl get --print-value-only "$catalog_key" >"$out/catalog.json"
  [ -s "$out/catalog.json" ] || die "no catalog in etcd at $catalog_key"
  for i in $(seq 60); do
    compose logs limiter1 2>/dev/null | grep -q 'limiter running' && break
    sleep 1
  done
  say "publishing $events impressions (10% duplicates) to nats://127.0.0.1:4222"
  started=$(date +%s)
  # As an ad server: its NATS user, password and CA (adsim reads ADSPEND_NATS_*).
  [ -f "$secrets/adserver.env" ] || die "no $secrets/adserver.env: bash scripts/cluster.sh up generates it"
  ( set -a; . "$secrets/adserver.env"; set +a
  "$tools/adsim" run --nats-url nats://127.0.0.1:4222 --catalog "$out/catalog.json" \
    --truth-out "$out/run-truth.json" --events "$events" --duplicate-rate 0.1 --batch 100 )
  add_to_demo_truth "$out/run-truth.json"
  # As a host client of the pacer: its URL, CA and read token.
  ( set -a; [ ! -f "$secrets/pacer-client.env" ] || . "$secrets/pacer-client.env"; set +a
  "$tools/adcheck" --pacer "$(pacer_url)" --truth "$(demo_truth)" --timeout 120 --show 15 )
  say "pacer equal to the truth $(elapsed "$started") after the first publish"
}

# pacer1's freshness histogram (adspend_pacer_freshness_seconds), "le count"
# per line, from its metrics port at its address on the data network.
freshness_buckets() {
  local ip
  ip=$(docker inspect -f '{{range .NetworkSettings.Networks}}{{.IPAddress}} {{end}}' "$(container pacer1)" | awk '{print $1}')
  curl -sf "http://$ip:9103/metrics" \
    | sed -n 's/^adspend_pacer_freshness_seconds_bucket{.*le="\([^"]*\)".*} \([0-9.e+]*\)$/\1 \2/p'
}

cmd_freshness() {
  require_docker
  local rate=${1:-45000} secs=${2:-60} out="$root/target/cluster-demo" before after
  [[ "$rate" =~ ^[0-9]+$ && "$secs" =~ ^[0-9]+$ ]] || die "freshness takes RATE (events/s) and SECONDS, both whole numbers"
  [ -n "$(container pacer1)" ] || die "the cluster is not running: bash scripts/cluster.sh up"
  say "building adsim (debug)"
  cargo build -p adspend-sim --bin adsim
  mkdir -p "$out"
  docker exec "$(container etcd1)" etcdctl get --print-value-only "$catalog_key" >"$out/catalog.json"
  [ -s "$out/catalog.json" ] || die "no catalog in etcd at $catalog_key"
  before=$(freshness_buckets) || die "pacer1's metrics (port 9103) do not answer"
  say "publishing $rate events/s for ${secs}s (10% duplicates) as the adserver role"
  ( set -a; . "$secrets/adserver.env"; set +a
  "$target_dir/debug/adsim" run --nats-url nats://127.0.0.1:4222 --catalog "$out/catalog.json" \
    --truth-out "$out/freshness-truth.json" --events $((rate * secs)) --duration "${secs}s" \
    --rate "$rate" --duplicate-rate 0.1 --batch 100 )
  add_to_demo_truth "$out/freshness-truth.json"
  sleep 3
  after=$(freshness_buckets)
  # Quantiles of the run's pushes as the histogram's bucket bounds (p99 <= X).
  python3 - "$before" "$after" "$rate" <<'PY'
import sys
def parse(text):
    return {le: float(n) for le, n in (line.split() for line in text.splitlines() if line.strip())}
before, after = parse(sys.argv[1]), parse(sys.argv[2])
bounds = sorted((float("inf") if le == "+Inf" else float(le), after[le] - before.get(le, 0)) for le in after)
total = bounds[-1][1]
if total <= 0:
    sys.exit("cluster: pacer1 received no pushes with new spend during the run")
def q(p):
    return next(le for le, n in bounds if n >= p * total)
show = lambda s: "over 30 s" if s == float("inf") else "%.0f ms" % (s * 1000)
print("cluster: pacer1 freshness at %s events/s over %d pushes: p50 <= %s, p90 <= %s, p99 <= %s (bucket bounds)"
      % (sys.argv[3], total, show(q(0.5)), show(q(0.9)), show(q(0.99))))
PY
}

cmd_chaos() {
  require_docker
  [ -n "$(container pacer1)" ] || die "the cluster is not running: bash scripts/cluster.sh up"
  say "building adclusterchaos (debug)"
  cargo build -p adspend-chaos --bin adclusterchaos
  ADSPEND_CLUSTER_PROJECT="$project" exec "$target_dir/debug/adclusterchaos" "$@"
}

cmd_failover() {
  local runs=10
  case "${1:-}" in --runs) runs=${2:?--runs N}; shift 2 ;; esac
  [ $# -eq 0 ] || die "failover: unknown arguments: $* (failover [--runs N])"
  cmd_chaos --failover-runs "$runs" --rate 1500
}

case "${1:-}" in
  up)
    shift
    bash "$root/scripts/install-deps.sh" cluster
    cmd_images
    cmd_start "$@"
    ;;
  down) cmd_down ;;
  images) cmd_images ;;
  secrets) shift; cmd_secrets "$@" ;;
  start) shift; cmd_start "$@" ;;
  status) cmd_status ;;
  logs) shift; compose --profile scale logs --tail "${LINES:-50}" "$@" ;;
  scale) shift; cmd_scale "$@" ;;
  demo) shift; cmd_demo "$@" ;;
  chaos) shift; cmd_chaos "$@" ;;
  failover) shift; cmd_failover "$@" ;;
  freshness) shift; cmd_freshness "$@" ;;
  *)
    sed -n '2,27p' "$0" | sed 's/^# \{0,1\}//' >&2
    exit 2
    ;;
esac
