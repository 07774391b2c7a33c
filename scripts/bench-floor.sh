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
# shellcheck source=scripts/common.sh
source scripts/common.sh

redis_port=$(free_port)
start_redis "$redis_port" "$work"
redis_url="redis://127.0.0.1:$redis_port/"

port=$(free_port)
"$bin" serve --listen "127.0.0.1:$port" --redis-url "$redis_url" --log-level warn \
    >>"$work/broker.log" 2>&1 &
broker_pid=$!
pids+=("$broker_pid")
until [[ $(curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:$port/readyz") == 200 ]]; do
    kill -0 "$broker_pid" 2>/dev/null || { cat "$work/broker.log"; exit 1; }
    sleep 0.05
done

"$bench_bin" --url "http://127.0.0.1:$port" --redis-url "$redis_url" \
    --broker-pid "$broker_pid" "${modes[@]}" "${extra[@]}"
