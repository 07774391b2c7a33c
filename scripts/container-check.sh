#!/usr/bin/env bash
# CI's container check of the deliverables users run: builds the image from the Dockerfile
# (with the engine's layer cache) and fails if it does not build or lacks the benchmark
# (`lockbroker-bench --version` run in it), then brings up
# deploy/compose.yaml (three brokers on one Redis behind nginx) and deploy/compose-sentinel.yaml
# (the same on a Sentinel-managed master with two replicas) one after the other, and through
# nginx takes a lease, sees a second acquire refused 409, releases it with its token (204), and
# takes the key again (201, a higher fence); then tears the deployment down. The Sentinel
# failover timing is scripts/container-failover.sh (minutes; not run by CI).
#
#   scripts/container-check.sh
#
# Sets up the container engine first (scripts/containers.sh: podman and local stand-ins for the
# base images; root). Environment: LOCKBROKER_HTTP_PORT, nginx's host port (default: a free one);
# DOCKER_HOST (default: the podman socket of scripts/containers.sh).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

started_s=$SECONDS
own_engine=false
if [[ -z "${DOCKER_HOST:-}" ]]; then
    scripts/containers.sh >&2
    own_engine=true
fi
if [[ -z "${LOCKBROKER_HTTP_PORT:-}" ]]; then
    LOCKBROKER_HTTP_PORT=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
fi
# shellcheck source=scripts/containers-common.sh
source scripts/containers-common.sh

projects=()
teardown() {
    local p
    for p in ${projects[@]+"${projects[@]}"}; do
        # shellcheck disable=SC2086
        docker-compose $p down -v --remove-orphans >/dev/null 2>&1 || true
    done
}
trap teardown EXIT

# check NAME FILE: brings FILE up as project NAME, runs one lease's cycle through nginx, and
# tears it down.
check() {
    local name=$1 file=$2 compose up_at answer token fence again released next
    compose=(docker-compose -p "$name" -f "$file")
    projects+=("-p $name -f $file")
    "${compose[@]}" down -v --remove-orphans >/dev/null 2>&1 || true
    log "$file: up"
    up_at=$(now_ms)
    up "${compose[@]}"
    if ! first_grant 180 >/dev/null; then
        echo "FAIL: $file granted nothing through nginx within 180 s of up" >&2
        "${compose[@]}" ps >&2 || true
        "${compose[@]}" logs --no-color --tail 30 >&2 || true
        exit 1
    fi
    log "$file: granting $((($(now_ms) - up_at) / 1000)) s after up"
    answer=$(acquire ci:cycle "ttl_ms=30000")
    [[ "$answer" == 201* ]] || { echo "FAIL: $file: acquire: $answer" >&2; exit 1; }
    token=$(field token <<<"$answer")
    fence=$(field fence <<<"$answer")
    again=$(acquire ci:cycle "")
    [[ "$again" == 409* ]] || { echo "FAIL: $file granted a held key twice: $again" >&2; exit 1; }
    released=$(release ci:cycle "$token")
    [[ "$released" == 204 ]] || { echo "FAIL: $file: release answered $released" >&2; exit 1; }
    next=$(acquire ci:cycle "ttl_ms=30000")
    [[ "$next" == 201* ]] || { echo "FAIL: $file: the released key was not granted again: $next" >&2; exit 1; }
    if (($(field fence <<<"$next") <= fence)); then
        echo "FAIL: $file: fence $(field fence <<<"$next") after $fence" >&2
        exit 1
    fi
    [[ "$(release ci:cycle "$(field token <<<"$next")")" == 204 ]] || { echo "FAIL: $file: second release" >&2; exit 1; }
    echo "$file: granted through nginx (fence $fence), a held key refused 409, released 204, granted again (fence $(field fence <<<"$next"))"
    "${compose[@]}" down -v --remove-orphans >/dev/null 2>&1
}

build_image
# The benchmark ships beside the broker.
bench_runs() { docker run --rm --entrypoint lockbroker-bench lockbroker:local --version >/dev/null; }
if ! bench_runs; then
    # After a long build the engine's API service was once seen to answer every `docker run`
    # with "unable to upgrade to tcp, received 409" (podman itself ran the image): our own engine
    # gets its service started anew, once, before the image is judged.
    $own_engine || { echo "FAIL: the image has no working /usr/local/bin/lockbroker-bench" >&2; exit 1; }
    echo "the engine could not run a container: starting its API service again" >&2
    scripts/containers.sh --restart >/dev/null
    bench_runs || { echo "FAIL: the image has no working /usr/local/bin/lockbroker-bench" >&2; exit 1; }
fi
check lockbroker-ci deploy/compose.yaml
check lockbroker-sentinel-ci deploy/compose-sentinel.yaml
echo "container check passed in $((SECONDS - started_s)) s"
