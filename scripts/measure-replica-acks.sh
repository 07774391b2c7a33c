#!/usr/bin/env bash
# What replica acknowledgements cost: `lockbroker-bench` against a release-build broker on a
# Redis master whose one replica sits behind a link that delays every byte by 1 ms each way
# (a replica in another zone), once with --redis-replica-acks 0 and once with 1, and prints both
# tables (requests/s and latency percentiles of each phase).
#
#   scripts/measure-replica-acks.sh [delay_ms (default 1)] [extra bench flags, e.g. --duration 5s]
#
# The delaying link is the bench's `delay-link`, on loopback between the replica and the master
# (the replication stream, and the acknowledgements WAIT asks for, both cross it). Needs
# redis-server, redis-cli, python3 and curl. Everything binds 127.0.0.1 and stops by itself.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
delay_ms=${1:-1}
shift || true
# shellcheck source=scripts/common.sh
source scripts/common.sh


master=$(free_port)
start_redis "$master" "$work/master" --repl-diskless-sync-delay 0
# The delaying link (`lockbroker-bench delay-link`): every chunk is forwarded delay_ms after it
# arrived, in order, both ways. It prints the address it bound.
"$bench_bin" delay-link --upstream "127.0.0.1:$master" --delay "${delay_ms}ms" >"$work/link.out" 2>"$work/link.log" &
link_pid=$!
pids+=("$link_pid")
until [[ -s $work/link.out ]]; do
    kill -0 "$link_pid" 2>/dev/null || { echo "the delaying link did not start:" >&2; cat "$work/link.log" >&2; exit 1; }
    sleep 0.05
done
link=$(sed -n 's/^127\.0\.0\.1://p' "$work/link.out")
replica=$(free_port)
start_redis "$replica" "$work/replica" --replicaof 127.0.0.1 "$link"
until redis-cli -p "$master" info replication | grep -q 'slave0:.*state=online'; do sleep 0.05; done
echo "replica online behind a ${delay_ms} ms link each way"

extra=("$@")
run() { # $1: replica acks
    local port; port=$(free_port)
    "$bin" serve --listen "127.0.0.1:$port" --redis-url "redis://127.0.0.1:$master" \
        --redis-replica-acks "$1" --log-level warn >>"$work/broker.log" 2>&1 &
    local pid=$!
    pids+=("$pid")
    until [[ $(curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:$port/readyz") == 200 ]]; do
        sleep 0.05
    done
    echo
    echo "== --redis-replica-acks $1, the replica ${delay_ms} ms away each way =="
    "$bench_bin" --url "http://127.0.0.1:$port" ${extra[@]+"${extra[@]}"}
    kill "$pid"
}
run 0
run 1
