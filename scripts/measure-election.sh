#!/usr/bin/env bash
# Measures leader-election failover with real processes: a redis-server, three brokers on it and
# three `lockbroker elect` candidates (one per broker), each running a command that writes a line
# when it starts and when SIGTERM stops it. Each round stops the leader twice — once with SIGTERM
# (elect stops its command, then releases: a handoff), once with SIGKILL to elect and its command
# together (a node that dies: its lease must end by itself) — and prints how long until the next
# leader's command started, and until `lockbroker status --watch` on another broker printed the new
# leader. A stopped candidate is started again, so three always stand.
#
#   scripts/measure-election.sh [ROUNDS] [TTL_MS]     (default: 5 rounds, 2000 ms)
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
rounds=${1:-5}
ttl_ms=${2:-2000}

cargo build --quiet --bin lockbroker
bin=$PWD/target/debug/lockbroker

free_port() {
    python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}
now_ns() { date +%s%N; }

work=$(mktemp -d)
pids=()
declare -A candidate
cleanup() {
    for name in "${!candidate[@]}"; do
        kill -TERM "${candidate[$name]}" 2>/dev/null || true
    done
    for pid in "${pids[@]}"; do
        kill "$pid" 2>/dev/null || true
    done
    wait 2>/dev/null || true
    rm -rf "$work"
}
trap cleanup EXIT

redis_port=$(free_port)
redis-server --port "$redis_port" --bind 127.0.0.1 --save '' --appendonly no --dir "$work" \
    >"$work/redis.log" 2>&1 &
pids+=($!)
urls=()
for i in 1 2 3; do
    port=$(free_port)
    "$bin" serve --listen "127.0.0.1:$port" --redis-url "redis://127.0.0.1:$redis_port" \
        --store-settle-ms 0 --log-level warn >"$work/broker-$i.log" 2>&1 &
    pids+=($!)
    urls+=("http://127.0.0.1:$port")
done
for url in "${urls[@]}"; do
    for _ in $(seq 100); do
        curl -fsS "$url/readyz" >/dev/null 2>&1 && break
        sleep 0.1
    done
done

log=$work/runs.log
touch "$log"
command='echo "start $NAME $(date +%s%N) $$" >> "$LOG"
trap '\''echo "stop $NAME $(date +%s%N)" >> "$LOG"; exit 0'\'' TERM
while :; do sleep 0.05; done'

stand() { # NAME BROKER_INDEX
    LOG=$log NAME=$1 "$bin" elect election --url "${urls[$2]}" --owner "$1" \
        --ttl "${ttl_ms}ms" --grace 5s -- sh -c "$command" 2>>"$work/elect-$1.log" &
    candidate[$1]=$!
}
stand a 0
stand b 1
stand c 2

# A follower on the third broker, printing one JSON line per change.
"$bin" status election --watch --json --url "${urls[2]}" >"$work/watch.jsonl" 2>&1 &
pids+=($!)

starts() { grep -c '^start' "$log" || true; }
# Waits for start line number $1 (at most 30 s); prints it.
wait_start() {
    for _ in $(seq 3000); do
        if [[ $(starts) -ge $1 ]]; then
            grep '^start' "$log" | sed -n "${1}p"
            return
        fi
        sleep 0.01
    done
    echo "no leader within 30 s" >&2
    exit 1
}
# The first `status --watch` line (after line $1) that shows owner $2 held: its seen_at_ms.
watch_seen_ms() {
    for _ in $(seq 3000); do
        seen=$(tail -n "+$(($1 + 1))" "$work/watch.jsonl" |
            python3 -c 'import json,sys
owner = sys.argv[1]
for line in sys.stdin:
    j = json.loads(line)
    if j.get("held") and j.get("owner") == owner:
        print(j["seen_at_ms"]); break' "$2")
        if [[ -n "$seen" ]]; then
            echo "$seen"
            return
        fi
        sleep 0.01
    done
    echo "status --watch did not show $2 within 30 s" >&2
    exit 1
}

n=1
leader=$(wait_start $n)
term_ms=()
kill_ms=()
term_watch_ms=()
kill_watch_ms=()
for round in $(seq "$rounds"); do
    for how in TERM KILL; do
        name=$(awk '{print $2}' <<<"$leader")
        group=$(awk '{print $4}' <<<"$leader")
        watched=$(wc -l <"$work/watch.jsonl")
        sent=$(now_ns)
        if [[ $how == TERM ]]; then
            kill -TERM "${candidate[$name]}"
        else
            kill -KILL "${candidate[$name]}" 2>/dev/null || true
            kill -KILL -- "-$group" 2>/dev/null || true
        fi
        n=$((n + 1))
        leader=$(wait_start $n)
        next=$(awk '{print $2}' <<<"$leader")
        started=$(awk '{print $3}' <<<"$leader")
        seen_ms=$(watch_seen_ms "$watched" "$next")
        took=$(((started - sent) / 1000000))
        seen=$((seen_ms - sent / 1000000))
        echo "round $round: SIG$how to leader $name -> $next's command started after ${took} ms; status --watch showed $next after ${seen} ms"
        if [[ $how == TERM ]]; then
            term_ms+=("$took")
            term_watch_ms+=("$seen")
        else
            kill_ms+=("$took")
            kill_watch_ms+=("$seen")
        fi
        wait "${candidate[$name]}" 2>/dev/null || true
        # The stopped node comes back as a candidate, on the same broker.
        case $name in a) stand a 0 ;; b) stand b 1 ;; c) stand c 2 ;; esac
    done
done

summary() { # LABEL VALUES...
    local label=$1
    shift
    printf '%s\n' "$@" | sort -n | awk -v label="$label" '{v[NR] = $1} END {
        printf "%s: min %d ms, median %d ms, max %d ms (%d runs)\n", label, v[1], v[int((NR + 1) / 2)], v[NR], NR }'
}
echo "ttl ${ttl_ms} ms, ${rounds} rounds, debug build, $(nproc) cores"
summary "SIGTERM -> successor's command starts" "${term_ms[@]}"
summary "SIGTERM -> status --watch shows the successor" "${term_watch_ms[@]}"
summary "SIGKILL -> successor's command starts" "${kill_ms[@]}"
summary "SIGKILL -> status --watch shows the successor" "${kill_watch_ms[@]}"
