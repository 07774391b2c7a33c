#!/usr/bin/env bash
# Measures how long after Redis answers again a free key is granted, for a restart without
# persistence, a FLUSHALL and a restart from an append-only file, with two release-build
# brokers on default settings (store_settle_ms = 3000) and one live lease that must be put back.
#
#   scripts/measure-recovery.sh
#
# Needs redis-server, redis-cli and curl. Everything runs on 127.0.0.1 and stops by itself.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
# shellcheck source=scripts/common.sh
source scripts/common.sh

rport=$(free_port)
ports+=("$rport")
start_store() { # $1: yes|no (append-only file)
    redis-server --port "$rport" --bind 127.0.0.1 --save "" --appendonly "$1" --appendfsync always \
        --dir "$work" --daemonize yes --logfile "$work/redis.log" >/dev/null
    until redis-cli -p "$rport" ping >/dev/null 2>&1; do sleep 0.01; done
}
now_ms() { date +%s%3N; }
ready() { curl -s -o /dev/null -w '%{http_code}' "$1/readyz"; }

measure() { # $1: label, $2: yes|no (AOF), $3: restart|flush
    start_store "$2"
    local urls=()
    for _ in 1 2; do
        local port; port=$(free_port)
        "$bin" serve --listen "127.0.0.1:$port" --redis-url "redis://127.0.0.1:$rport/" \
            --log-level warn >>"$work/broker.log" 2>&1 &
        pids+=($!)
        urls+=("http://127.0.0.1:$port")
    done
    for u in "${urls[@]}"; do until [[ $(ready "$u") == 200 ]]; do sleep 0.05; done; done
    local held; held=$(curl -s -X POST "${urls[0]}/locks/held?ttl_ms=60000")
    local t0
    if [[ $3 == restart ]]; then
        redis-cli -p "$rport" shutdown nosave >/dev/null 2>&1 || true
        start_store "$2"
    else
        redis-cli -p "$rport" flushall >/dev/null
    fi
    t0=$(now_ms)
    until [[ $(curl -s -o /dev/null -w '%{http_code}' -X POST "${urls[1]}/locks/free-$RANDOM?ttl_ms=1000") == 201 ]]; do
        sleep 0.01
    done
    local t1; t1=$(now_ms)
    local kept; kept=$(curl -s -o /dev/null -w '%{http_code}' -X POST "${urls[1]}/locks/held")
    printf '%-40s first grant %5d ms after Redis answered; the live lease answers %s\n' \
        "$1" $((t1 - t0)) "$kept"
    [[ $kept == 409 ]] || { echo "the live lease was not put back: $held" >&2; exit 1; }
    kill "${pids[@]}"; wait "${pids[@]}" 2>/dev/null || true; pids=()
    redis-cli -p "$rport" shutdown nosave >/dev/null 2>&1 || true
    rm -rf "${work:?}"/appendonlydir
}

measure "restart without persistence" no restart
measure "FLUSHALL" no flush
measure "restart from the append-only file" yes restart
