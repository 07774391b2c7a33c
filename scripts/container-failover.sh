#!/usr/bin/env bash
# The container check of the deployment files: builds the image, brings up deploy/compose.yaml
# and grants through its nginx, then deploy/compose-sentinel.yaml, once per run: a live lease is
# taken through nginx, clients keep acquiring and releasing through nginx, the Sentinel master's
# container is killed (SIGKILL, docker kill), and the script polls nginx with acquires of free
# keys until one is granted. For each run it prints, counted from the kill: when the sentinels
# called the master down and switched to a replica (from their logs), when a free key was granted
# again, and when the master's process really died; and it checks that the live lease is still
# held, same fence. Exits non-zero if a run's first grant
# comes later than the bound (15 s by default) or the lease was lost. Tears everything down.
#
#   scripts/container-failover.sh [RUNS]        # 3 runs by default
#
# Environment:
#   DOCKER_HOST              the engine (default: the podman socket of
#                            scripts/containers.sh when it exists)
#   LOCKBROKER_SKIP_BUILD=1  use the lockbroker:local image as it is
#   RESUME_BOUND_S=15        a run whose first grant comes later fails
#   LOCKBROKER_HTTP_PORT     nginx's host port (8080)
#
# Needs docker (or podman's docker-compatible API) with docker-compose, and curl. It takes
# minutes: the image build alone is a release build of the broker. Uses the compose projects
# lockbroker-check and lockbroker-sentinel-check, removed (with their volumes) at the end.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

runs=${1:-3}
bound_s=${RESUME_BOUND_S:-15}
# shellcheck source=scripts/containers-common.sh
source scripts/containers-common.sh
single=(docker-compose -p lockbroker-check -f deploy/compose.yaml)
sentinel=(docker-compose -p lockbroker-sentinel-check -f deploy/compose-sentinel.yaml)
loaders=()

stop_load() {
    if [[ ${#loaders[@]} -gt 0 ]]; then kill "${loaders[@]}" 2>/dev/null || true; fi
    loaders=()
}
teardown() {
    stop_load
    "${single[@]}" down -v --remove-orphans >/dev/null 2>&1 || true
    "${sentinel[@]}" down -v --remove-orphans >/dev/null 2>&1 || true
}
trap teardown EXIT

# Clients acquiring and releasing keys of their own through nginx, until stopped.
start_load() {
    local i
    for i in 1 2 3 4; do
        (
            while true; do
                token=$(curl -s --max-time 5 -X POST "$base/locks/check:load-$i?ttl_ms=5000" | field token)
                if [[ -n "$token" ]]; then
                    curl -s --max-time 5 -o /dev/null -X DELETE -H "Lock-Token: $token" "$base/locks/check:load-$i" || true
                else
                    sleep 0.05
                fi
            done
        ) >/dev/null 2>&1 &
        loaders+=($!)
    done
}

# The time (ms since the epoch) of the first line of `container`'s log after `since_ms` that
# contains `event` (the sentinels log "+sdown master", "+switch-master", with milliseconds).
event_ms() {
    local container=$1 event=$2 since_ms=$3 line stamp
    while read -r line; do
        stamp=$(sed -n 's/^[0-9]*:X \([0-9]* [A-Z][a-z]* [0-9]* [0-9:.]*\) .*/\1/p' <<<"$line")
        [[ -n "$stamp" ]] || continue
        ms=$(date -d "$stamp" +%s%3N 2>/dev/null) || continue
        if ((ms >= since_ms)); then
            echo "$ms"
            return
        fi
    done < <("${sentinel[@]}" logs --no-color "$container" 2>/dev/null | sed 's/^[^|]*| //' | grep -F -- "$event")
    echo ""
}
since() { [[ -n "$2" ]] && awk -v a="$1" -v b="$2" 'BEGIN { printf "%.1f s", (b - a) / 1000 }' || echo "-"; }

if [[ "${LOCKBROKER_SKIP_BUILD:-}" != 1 ]]; then
    build_image
fi
teardown

log "deploy/compose.yaml: up"
up "${single[@]}"
grant_at=$(first_grant 120) || { echo "FAIL: deploy/compose.yaml granted nothing within 120 s" >&2; exit 1; }
answer=$(acquire check:single "ttl_ms=30000")
[[ "$answer" == 201* ]] || { echo "FAIL: deploy/compose.yaml: $answer" >&2; exit 1; }
again=$(acquire check:single "")
[[ "$again" == 409* ]] || { echo "FAIL: deploy/compose.yaml granted a held key twice: $again" >&2; exit 1; }
echo "deploy/compose.yaml: granted through nginx; a held key refused 409"
"${single[@]}" down -v --remove-orphans >/dev/null 2>&1

failed=0
results=()
for run in $(seq "$runs"); do
    log "run $run: deploy/compose-sentinel.yaml: up (returns once the sentinels can fail over)"
    up_started=$(now_ms)
    up "${sentinel[@]}"
    first_grant 120 >/dev/null || { echo "FAIL: run $run: the Sentinel deployment granted nothing within 120 s of up" >&2; exit 1; }
    log "run $run: granting after $(since "$up_started" "$(now_ms)")"
    held=$(acquire check:held "ttl_ms=120000")
    [[ "$held" == 201* ]] || { echo "FAIL: run $run: the live lease: $held" >&2; exit 1; }
    fence=$(field fence <<<"$held")
    start_load
    sleep 2
    # The engine's own kill, on the container found beforehand: `docker-compose kill` first
    # lists the project's containers, which took 5 to 7 s on a loaded host before the process
    # died, and that is not failover time.
    master=$("${sentinel[@]}" ps -q redis-master)
    killed=$(now_ms)
    docker kill "$master" >/dev/null
    log "run $run: killed redis-master"
    granted=$(first_grant 60) || granted=""
    stop_load
    # When the master's process really died (the engine may take a moment to carry out a kill).
    died=$(docker inspect -f '{{.State.FinishedAt}}' "$master" 2>/dev/null |
        xargs -r -I{} date -d {} +%s%3N 2>/dev/null) || died=""
    sdown=$(event_ms sentinel1 "+sdown master" "$killed")
    switched=$(event_ms sentinel1 "+switch-master" "$killed")
    shown=$(curl -s --max-time 5 "$base/locks/check:held")
    again=$(acquire check:held "")
    still_held=no
    if [[ "$(field fence <<<"$shown")" == "$fence" && "$again" == 409* ]]; then still_held=yes; fi
    line="run $run: kill -> master down $(since "$killed" "$sdown"), switched $(since "$killed" "$switched"), first grant $(since "$killed" "$granted") (process died $(since "$killed" "$died") after the kill command: $(since "$died" "$granted") from its death to the grant); live lease (fence $fence) still held: $still_held"
    echo "$line"
    results+=("$line")
    if [[ -z "$granted" ]] || ((granted - killed > bound_s * 1000)) || [[ "$still_held" != yes ]]; then
        failed=1
        "${sentinel[@]}" logs --no-color --tail 40 sentinel1 broker1 >&2 2>/dev/null || true
    fi
    "${sentinel[@]}" down -v --remove-orphans >/dev/null 2>&1
done

echo "summary (bound ${bound_s} s from the kill to a free key granted):"
printf '  %s\n' "${results[@]}"
exit "$failed"
