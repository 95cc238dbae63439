# Waiting on compose services, sourced by scripts/cluster.sh and
# scripts/regions.sh; the sourcing script defines compose, container, say,
# die and elapsed.

# Health of one compose service's container: healthy, starting, unhealthy, exited, or missing.
health() {
  local id
  id=$(container "$1" 2>/dev/null || true)
  [ -n "$id" ] || { echo missing; return; }
  docker inspect -f '{{if .State.Running}}{{if .State.Health}}{{.State.Health.Status}}{{else}}running{{end}}{{else}}exited{{end}}' "$id" 2>/dev/null || echo missing
}

# wait_healthy TIMEOUT_SECONDS SERVICE...: returns when every one is healthy;
# dies with their last log lines when one exits or time runs out.
wait_healthy() {
  local timeout=$1 started pending s
  shift
  started=$(date +%s)
  while :; do
    pending=()
    for s in "$@"; do
      case $(health "$s") in
        healthy) ;;
        exited) compose logs --tail 20 "$s" >&2; die "$s exited while starting (its last log lines are above)" ;;
        *) pending+=("$s") ;;
      esac
    done
    [ ${#pending[@]} -eq 0 ] && { say "healthy after $(elapsed "$started"): $*"; return; }
    if [ $(( $(date +%s) - started )) -ge "$timeout" ]; then
      compose logs --tail 20 "${pending[@]}" >&2
      die "not healthy after ${timeout}s: ${pending[*]} (their last log lines are above)"
    fi
    sleep 1
  done
}

# require_docker: Docker and docker-compose are there and the daemon answers.
require_docker() {
  command -v docker >/dev/null || die "docker is not installed"
  command -v docker-compose >/dev/null || die "docker-compose is not installed (bash scripts/install-deps.sh cluster)"
  docker info >/dev/null 2>&1 || die "cannot talk to the Docker daemon (is it running? are you root or in the docker group?)"
}
