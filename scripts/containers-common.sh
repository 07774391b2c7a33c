# What the container scripts (container-check.sh, container-failover.sh) share, sourced after
# `set -euo pipefail` and the cd to the repository: the engine (DOCKER_HOST: the podman socket
# of scripts/containers.sh when it exists), the broker's address through nginx ($base, on
# LOCKBROKER_HTTP_PORT, 8080 by default), and small helpers over curl.

port=${LOCKBROKER_HTTP_PORT:-8080}
export LOCKBROKER_HTTP_PORT=$port
if [[ -z "${DOCKER_HOST:-}" && -S /run/lockbroker-podman.sock ]]; then
    export DOCKER_HOST=unix:///run/lockbroker-podman.sock
fi
base=http://127.0.0.1:$port

now_ms() { date +%s%3N; }
log() { printf '%s %s\n' "$(date -u +%H:%M:%S)" "$*" >&2; }

# acquire KEY QUERY: prints "STATUS BODY" for POST /locks/KEY through nginx.
acquire() {
    curl -s --max-time 5 -X POST -w ' %{http_code}' "$base/locks/$1?$2" | awk '{ code = $NF; $NF = ""; print code, $0 }'
}
# release KEY TOKEN: prints the status of DELETE /locks/KEY through nginx.
release() {
    curl -s --max-time 5 -o /dev/null -w '%{http_code}' -X DELETE -H "Lock-Token: $2" "$base/locks/$1"
}
# field NAME: the value of a JSON field in the body on standard input (flat bodies only).
field() { sed -n "s/.*\"$1\":\"\{0,1\}\([^\",}]*\).*/\1/p"; }

# Polls nginx until a free key is granted; prints when (ms since the epoch). Gives up after $1 s.
first_grant() {
    local limit=$1 started n=0 answer
    started=$(now_ms)
    while (($(now_ms) - started < limit * 1000)); do
        answer=$(acquire "check:free-$RANDOM-$n" "ttl_ms=5000") || true
        if [[ "$answer" == 201* ]]; then
            now_ms
            return 0
        fi
        n=$((n + 1))
        sleep 0.05
    done
    return 1
}

# up COMPOSE-COMMAND...: brings the project up, showing the engine's output only if it fails.
up() {
    local out
    out=$("$@" up -d 2>&1) || { printf '%s\nFAIL: %s up\n' "$out" "${*: -1}" >&2; exit 1; }
}

# build_image: builds lockbroker:local from the Dockerfile, with the engine's layer cache (the
# dependencies' layer is rebuilt only when a manifest or Cargo.lock changes). Fails, showing
# the build's output, when the image does not build.
build_image() {
    local out started
    started=$(now_ms)
    log "building the image lockbroker:local"
    if ! out=$(docker build -t lockbroker:local . 2>&1); then
        printf '%s\n' "$out" | tail -40 >&2
        echo "FAIL: the Dockerfile does not build" >&2
        exit 1
    fi
    log "image built in $(((($(now_ms) - started) + 500) / 1000)) s"
}
