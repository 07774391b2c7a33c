#!/usr/bin/env bash
# Checks the API against its own OpenAPI document with schemathesis: every request the document
# allows must be accepted, every one it forbids refused, and every answer (status, content type,
# headers, body) documented.
#
#   scripts/schemathesis.sh [--redis] [extra schemathesis run arguments...]
#
# Builds the broker, starts it on a free loopback port (on the embedded store, or with --redis on
# a redis-server this script starts on another free loopback port), runs
# `schemathesis run --phases examples,fuzzing --checks all` against /openapi.json with the rules
# OpenAPI cannot state (scripts/schemathesis_hooks.py), and stops what it started. schemathesis
# is installed with pip into target/schemathesis-venv if it is not on PATH. Exit status:
# schemathesis's (0: no failure).
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."

store=embedded
if [[ "${1:-}" == "--redis" ]]; then
    store=redis
    shift
fi

if command -v schemathesis >/dev/null 2>&1; then
    schemathesis=(schemathesis)
else
    venv=target/schemathesis-venv
    if [[ ! -x "$venv/bin/schemathesis" ]]; then
        echo "schemathesis not found: installing it with pip into $venv."
        python3 -m venv "$venv"
        "$venv/bin/pip" install --quiet schemathesis
    fi
    schemathesis=("$venv/bin/schemathesis")
fi
"${schemathesis[@]}" --version

cargo build --quiet --bin lockbroker

# A free loopback port (the kernel's choice; released at once, so another process could take it
# first: the broker would then fail to start, and so would this script, loudly).
free_port() {
    python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

work=$(mktemp -d)
pids=()
cleanup() {
    for pid in "${pids[@]}"; do
        kill "$pid" 2>/dev/null || true
        wait "$pid" 2>/dev/null || true
    done
    rm -rf "$work"
}
trap cleanup EXIT

# A waiting acquire ends within max_wait_ms (the document's `maximum` of wait_ms says so), so
# that fuzzed acquires on keys that earlier ones hold answer well within schemathesis's timeout.
args=(--max-wait-ms 1000)
if [[ "$store" == redis ]]; then
    redis_port=$(free_port)
    redis-server --port "$redis_port" --bind 127.0.0.1 --save '' --appendonly no \
        --dir "$work" >"$work/redis.log" 2>&1 &
    pids+=($!)
    args+=(--redis-url "redis://127.0.0.1:$redis_port" --store-settle-ms 0)
fi

port=$(free_port)
target/debug/lockbroker serve --listen "127.0.0.1:$port" "${args[@]}" \
    >"$work/broker.log" 2>&1 &
pids+=($!)

# Ready: the store answers and no hold is in force.
for _ in $(seq 100); do
    if curl -fsS "http://127.0.0.1:$port/readyz" >/dev/null 2>&1; then
        break
    fi
    sleep 0.1
done
curl -fsS "http://127.0.0.1:$port/readyz" >/dev/null || {
    echo "error: the broker did not become ready; its log:" >&2
    cat "$work/broker.log" >&2
    exit 1
}

# From the scratch directory, where schemathesis keeps its cache, removed on exit.
hooks="$PWD/scripts/schemathesis_hooks.py"
if [[ "${schemathesis[0]}" != schemathesis ]]; then
    schemathesis[0]="$PWD/${schemathesis[0]}"
fi
cd "$work"
SCHEMATHESIS_HOOKS="$hooks" "${schemathesis[@]}" run \
    "http://127.0.0.1:$port/openapi.json" \
    --phases examples,fuzzing --checks all "$@"
