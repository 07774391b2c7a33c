#!/bin/sh
# A sentinel's health check (deploy/compose-sentinel.yaml): healthy only once this sentinel can
# take part in a failover, that is when it
#   - sees the master up (flags exactly "master": not down, no failover under way),
#   - knows both replicas, each up (flags exactly "slave"), so it has one to promote,
#   - knows both other sentinels, each up (flags exactly "sentinel"), so a majority can agree.
# A sentinel learns the replicas from the master's INFO and the other sentinels from their hello
# messages, seconds after it starts; a failover before that cannot succeed, so the brokers
# (depends_on: service_healthy) start after it. Later, while a server or a sentinel is down, it
# reports unhealthy: the deployment then survives no further loss.
#
#   sentinel-ready.sh [MASTER_NAME] [REPLICAS] [SENTINELS]    # lockbroker 2 3 by default
set -eu
name=${1:-lockbroker}
replicas=${2:-2}
others=$((${3:-3} - 1))
cli() { redis-cli -p 26379 --raw "$@"; }
# How many of the instances listed have exactly these flags (each listed as field/value lines).
count_up() { awk -v want="$1" 'field == "flags" && $0 == want { n++ } { field = $0 } END { print n + 0 }'; }

master=$(cli sentinel master "$name" | count_up master)
up_replicas=$(cli sentinel replicas "$name" | count_up slave)
up_sentinels=$(cli sentinel sentinels "$name" | count_up sentinel)
if [ "$master" -ne 1 ] || [ "$up_replicas" -lt "$replicas" ] || [ "$up_sentinels" -lt "$others" ]; then
    echo "not ready: master up $master, replicas up $up_replicas of $replicas, other sentinels up $up_sentinels of $others"
    exit 1
fi
echo "ready: master up, $up_replicas replicas, $up_sentinels other sentinels"
