#!/usr/bin/env bash
# Measures how long after the Redis master is killed (SIGKILL) a free key is granted again,
# behind Redis Sentinel: two release-build brokers on default settings (store_settle_ms = 3000)
# on a master, two replicas and three sentinels (down-after-milliseconds 1000, failover-timeout
# 5000), with one live lease that must still be held afterwards. Each run starts a fresh
# deployment, kills the master, and polls a broker with acquires of free keys every 10 ms; it
# prints when the sentinels named the new master and when the first grant came, both counted
# from the kill.
#
#   scripts/measure-failover.sh [RUNS]     # 3 runs by default
#
# Needs redis-server, redis-cli, curl and python3. Everything runs on 127.0.0.1 and stops by
# itself.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
cargo build --release -q
bin=target/release/lockbroker
runs=${1:-3}
work=$(mktemp -d)
pids=()
ports=()
config=""
cleanup() {
    kill "${pids[@]}" 2>/dev/null || true
    for p in "${ports[@]}"; do redis-cli -p "$p" shutdown nosave >/dev/null 2>&1 || true; done
    rm -rf "$work"
}
trap cleanup EXIT

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
now_ms() { date +%s%3N; }
code() { curl -s -o /dev/null -w '%{http_code}' "$@"; }
master_named() { redis-cli -p "$1" sentinel get-master-addr-by-name lockbroker 2>/dev/null | tail -1; }

start_server() { # $1: port, then extra arguments (a sentinel: its config file first, then --sentinel)
    local port=$1; shift
    mkdir -p "$work/$port"
    redis-server ${config:+"$config"} --port "$port" --bind 127.0.0.1 --save "" --appendonly no --dir "$work/$port" \
        --repl-diskless-sync-delay 0 --daemonize yes --pidfile "$work/$port/pid" \
        --logfile "$work/$port/log" "$@" >/dev/null
    ports+=("$port")
    until redis-cli -p "$port" ping >/dev/null 2>&1; do sleep 0.01; done
}

measure() { # $1: run number
    local master r1 r2 s urls=() sentinels=()
    master=$(free_port); r1=$(free_port); r2=$(free_port)
    start_server "$master"
    start_server "$r1" --replicaof 127.0.0.1 "$master"
    start_server "$r2" --replicaof 127.0.0.1 "$master"
    for r in "$r1" "$r2"; do
        until redis-cli -p "$r" info replication | grep -q 'master_link_status:up'; do sleep 0.05; done
    done
    for _ in 1 2 3; do
        s=$(free_port)
        mkdir -p "$work/$s"
        printf '%s\n' "sentinel monitor lockbroker 127.0.0.1 $master 2" \
            "sentinel down-after-milliseconds lockbroker 1000" \
            "sentinel failover-timeout lockbroker 5000" >"$work/$s/sentinel.conf"
        config="$work/$s/sentinel.conf" start_server "$s" --sentinel
        sentinels+=("$s")
    done
    for s in "${sentinels[@]}"; do
        until redis-cli -p "$s" sentinel ckquorum lockbroker 2>/dev/null | grep -q '^OK' &&
            [[ $(redis-cli -p "$s" sentinel master lockbroker | grep -A1 '^num-other-sentinels$' | tail -1) == 2 ]] &&
            [[ $(redis-cli -p "$s" sentinel master lockbroker | grep -A1 '^num-slaves$' | tail -1) == 2 ]]; do
            sleep 0.1
        done
    done
    local url="redis+sentinel://127.0.0.1:${sentinels[0]},127.0.0.1:${sentinels[1]},127.0.0.1:${sentinels[2]}/lockbroker"
    for _ in 1 2; do
        local port; port=$(free_port)
        "$bin" serve --listen "127.0.0.1:$port" --redis-url "$url" --log-level warn \
            >>"$work/broker.log" 2>&1 &
        pids+=($!)
        urls+=("http://127.0.0.1:$port")
    done
    for u in "${urls[@]}"; do until [[ $(code "$u/readyz") == 200 ]]; do sleep 0.05; done; done
    [[ $(code -X POST "${urls[0]}/locks/held?ttl_ms=60000") == 201 ]]

    kill -9 "$(cat "$work/$master/pid")"
    local t0 promoted="" n=0; t0=$(now_ms)
    until [[ $(code -X POST "${urls[1]}/locks/free-$n?ttl_ms=1000") == 201 ]]; do
        if [[ -z $promoted ]] && [[ $(master_named "${sentinels[0]}") != "$master" ]]; then
            promoted=$(now_ms)
        fi
        n=$((n + 1))
        sleep 0.01
    done
    local t1; t1=$(now_ms)
    [[ -n $promoted ]] || promoted=$t1
    local kept; kept=$(code -X POST "${urls[1]}/locks/held")
    printf 'run %d: new master named %5d ms after the kill; first grant %5d ms after the kill (%d ms after the promotion); the live lease answers %s\n' \
        "$1" $((promoted - t0)) $((t1 - t0)) $((t1 - promoted)) "$kept"
    [[ $kept == 409 ]] || { echo "the live lease was not kept" >&2; exit 1; }
    kill "${pids[@]}"; wait "${pids[@]}" 2>/dev/null || true; pids=()
    for p in "${ports[@]}"; do redis-cli -p "$p" shutdown nosave >/dev/null 2>&1 || true; done
    ports=()
}

for run in $(seq 1 "$runs"); do measure "$run"; done
