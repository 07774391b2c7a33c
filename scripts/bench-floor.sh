#!/usr/bin/env bash
# Measures the broker against its floor: builds the release binary, starts a redis-server of its
# own and a broker on free loopback ports, and runs `lockbroker-bench --floor --breakdown`: the
# uncontended lock cycle against the broker and against a minimal HTTP lock proxy (started by the
# bench) in alternating rounds, then Redis's time per step and command and the memory that
# released locks leave, for both. Extra arguments go to the bench:
#
#   scripts/bench-floor.sh [--duration 8s] [--rounds 3] [--json] [--no-breakdown] ...
#
# `--no-breakdown` (this script's own flag) runs the rounds only. Everything stops by itself.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
modes=(--floor --breakdown)
extra=()
for a in "$@"; do
    if [[ $a == --no-breakdown ]]; then modes=(--floor); else extra+=("$a"); fi
done
cargo build --release -q -p lockbroker -p lockbroker-bench
bin=target/release/lockbroker
bench_bin=target/release/lockbroker-bench
work=$(mktemp -d)
broker_pid=
redis_port=
cleanup() {
    [[ -n $broker_pid ]] && kill "$broker_pid" 2>/dev/null || true
    [[ -n $redis_port ]] && redis-cli -p "$redis_port" shutdown nosave >/dev/null 2>&1 || true
    rm -rf "$work"
}
trap cleanup EXIT

free_port() {
    python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

redis_port=$(free_port)
redis-server --port "$redis_port" --bind 127.0.0.1 --save "" --appendonly no --dir "$work" \
    --daemonize yes --logfile "$work/redis.log" >/dev/null
until redis-cli -p "$redis_port" ping >/dev/null 2>&1; do sleep 0.01; done
redis_url="redis://127.0.0.1:$redis_port/"

port=$(free_port)
"$bin" serve --listen "127.0.0.1:$port" --redis-url "$redis_url" --log-level warn \
    >>"$work/broker.log" 2>&1 &
broker_pid=$!
until [[ $(curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:$port/readyz") == 200 ]]; do
    kill -0 "$broker_pid" 2>/dev/null || { cat "$work/broker.log"; exit 1; }
    sleep 0.05
done

"$bench_bin" --url "http://127.0.0.1:$port" --redis-url "$redis_url" \
    --broker-pid "$broker_pid" "${modes[@]}" "${extra[@]}"
