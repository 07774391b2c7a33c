#!/usr/bin/env bash
# Runs `lockbroker-bench` on one Redis and on a 3-master Redis Cluster (3 replicas) in one run,
# one after the other, each with a release-build broker of its own, and prints both tables.
#
#   scripts/bench-cluster.sh [extra bench flags, e.g. --duration 5s]
#
# Needs redis-server and redis-cli. Everything runs on 127.0.0.1 and stops by itself. On a small
# machine the cluster's six servers share the cores with the broker and the load generator, so
# read the figures as what this machine does, not what a cluster of machines would.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
# shellcheck source=scripts/common.sh
source scripts/common.sh

free_port() { # a port below 55536 whose cluster bus port (+10000) is free too
    python3 -c '
import socket
while True:
    s = socket.socket(); s.bind(("127.0.0.1", 0)); p = s.getsockname()[1]
    if p < 55536:
        try:
            b = socket.socket(); b.bind(("127.0.0.1", p + 10000)); b.close(); print(p); break
        except OSError: pass
    s.close()'
}
broker() { # $1: redis url; prints the broker's base URL
    local port; port=$(free_port)
    "$bin" serve --listen "127.0.0.1:$port" --redis-url "$1" --log-level warn \
        >>"$work/broker.log" 2>&1 &
    pids+=($!)
    until [[ $(curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:$port/readyz") == 200 ]]; do
        sleep 0.05
    done
    echo "http://127.0.0.1:$port"
}

single=$(free_port)
start_redis "$single" "$work/single"
nodes=()
for i in 0 1 2 3 4 5; do
    p=$(free_port)
    start_redis "$p" "$work/node-$i" --cluster-enabled yes --cluster-config-file nodes.conf \
        --cluster-node-timeout 2000
    nodes+=("127.0.0.1:$p")
done
redis-cli --cluster create "${nodes[@]}" --cluster-replicas 1 --cluster-yes >/dev/null
for n in "${nodes[@]}"; do
    until redis-cli -p "${n##*:}" cluster info | grep -q cluster_state:ok; do sleep 0.1; done
done
cluster_url="redis+cluster://$(IFS=,; echo "${nodes[*]}")"

echo "== one Redis (redis://127.0.0.1:$single)"
url=$(broker "redis://127.0.0.1:$single/")
"$bench_bin" --url "$url" --redis-url "redis://127.0.0.1:$single/" "$@"
echo
echo "== Redis Cluster, 3 masters + 3 replicas ($cluster_url)"
url=$(broker "$cluster_url")
"$bench_bin" --url "$url" --redis-url "$cluster_url" "$@"
