#!/usr/bin/env bash
# One hot key through 1, 4, 8 and 16 brokers on one Redis: for each fleet size, starts that many
# release-build brokers on a Redis of its own, runs `lockbroker-bench --urls …` (16 clients
# looping acquire with wait_ms=20000 → hold 1 ms → release on one key, client i through broker
# i % B), stops the brokers, and prints one row per fleet size.
#
#   scripts/bench-fleet.sh [--duration 8s] [--brokers "1 4 8 16"] [extra bench flags]
#
# e.g. `--contenders 32`, `--hold 0ms`, `--wait-ms 5000`, `--json` (one JSON document per row).
# Needs redis-server, redis-cli, curl and python3. Everything listens on 127.0.0.1, each run is
# bounded in time, and the script stops what it started when it exits.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

duration=8s
fleets="1 4 8 16"
extra=()
while (($#)); do
    case $1 in
        --duration) duration=$2; shift 2 ;;
        --brokers) fleets=$2; shift 2 ;;
        *) extra+=("$1"); shift ;;
    esac
done

cargo build --release -q -p lockbroker -p lockbroker-bench
bin=target/release/lockbroker
bench_bin=target/release/lockbroker-bench
work=$(mktemp -d)
redis_port=
pids=()
stop_brokers() {
    ((${#pids[@]})) || return 0
    kill "${pids[@]}" 2>/dev/null || true
    # SIGTERM drains a broker; give them 10 s, then SIGKILL what is left.
    for _ in $(seq 100); do
        kill -0 "${pids[@]}" 2>/dev/null || break
        sleep 0.1
    done
    kill -KILL "${pids[@]}" 2>/dev/null || true
    wait "${pids[@]}" 2>/dev/null || true
    pids=()
}
cleanup() {
    stop_brokers
    [[ -n $redis_port ]] && redis-cli -p "$redis_port" shutdown nosave >/dev/null 2>&1 || true
    rm -rf "$work"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

seconds() { # a bench duration (8s, 1500ms, 2m) in whole seconds, rounded up
    local n=${1%%[!0-9]*} unit=${1##*[0-9]}
    case $unit in
        ms) echo $(((n + 999) / 1000)) ;;
        s | '') echo "$n" ;;
        m | min) echo $((n * 60)) ;;
        *) echo "--duration $1: give it as 8s, 1500ms or 2m" >&2; exit 2 ;;
    esac
}
free_port() {
    python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}
until_ready() { # $1: URL; $2: what; gives up after 30 s
    for _ in $(seq 600); do
        [[ $(curl -s -o /dev/null -w '%{http_code}' "$1") == 200 ]] && return 0
        sleep 0.05
    done
    echo "$2 did not become ready in 30 s; its log:" >&2
    cat "$work"/broker-*.log >&2 || true
    exit 1
}

seconds "$duration" >/dev/null
redis_port=$(free_port)
redis-server --port "$redis_port" --bind 127.0.0.1 --save "" --appendonly no --dir "$work" \
    --daemonize yes --logfile "$work/redis.log" >/dev/null
for _ in $(seq 100); do redis-cli -p "$redis_port" ping >/dev/null 2>&1 && break; sleep 0.05; done
redis_url="redis://127.0.0.1:$redis_port/"

echo "# $(nproc) cores, load average before: $(cut -d' ' -f1-3 /proc/loadavg); redis $(redis-server --version | grep -o 'v=[^ ]*'); $duration per row"
first=1
for b in $fleets; do
    urls=()
    for i in $(seq "$b"); do
        port=$(free_port)
        "$bin" serve --listen "127.0.0.1:$port" --redis-url "$redis_url" --log-level warn \
            >>"$work/broker-$i.log" 2>&1 &
        pids+=($!)
        urls+=("http://127.0.0.1:$port")
    done
    for u in "${urls[@]}"; do until_ready "$u/readyz" "the broker at $u"; done
    # The bench reads Redis's counters before and after its run; the reset only keeps each
    # row's INFO readable by hand.
    redis-cli -p "$redis_port" config resetstat >/dev/null
    # Bounded: the run, the drain of the last waiters, and the brokers' first grants.
    out=$(timeout --kill-after=5 "$(($(seconds "$duration") + 120))" \
        "$bench_bin" --urls "$(IFS=,; echo "${urls[*]}")" --redis-url "$redis_url" \
        --duration "$duration" "${extra[@]}")
    if ((first)) || [[ $out == "{"* ]]; then echo "$out"; else sed 1d <<<"$out"; fi
    first=0
    stop_brokers
done
echo "# load average after: $(cut -d' ' -f1-3 /proc/loadavg)"
echo "# evalsha/acq: script calls (EVALSHA, EVAL, FCALL) per acquisition; redis µs: Redis CPU"
echo "# (user+system) per acquisition; script µs: Redis's time inside those scripts (INFO"
echo "# commandstats) per acquisition; wait: acquire sent → 201 (ms); handoff: a release's 204 →"
echo "# the next grant's 201, paired by fence (ms); most/fewest: acquisitions of the luckiest"
echo "# client over the unluckiest's (inf: a client got none)"
