# What the measuring scripts (bench-cluster.sh, bench-floor.sh, measure-recovery.sh,
# measure-replica-acks.sh) share, sourced by each after `set -euo pipefail` and the cd to the
# repository: builds the release broker ($bin) and benchmark ($bench_bin), makes a scratch
# directory ($work), and on exit stops every process in `pids` and every redis-server whose port
# is in `ports`, and removes $work.

cargo build --release -q -p lockbroker -p lockbroker-bench
bin=target/release/lockbroker
bench_bin=target/release/lockbroker-bench
work=$(mktemp -d)
pids=()
ports=()
cleanup() {
    kill "${pids[@]}" 2>/dev/null || true
    for p in "${ports[@]}"; do redis-cli -p "$p" shutdown nosave >/dev/null 2>&1 || true; done
    rm -rf "$work"
}
trap cleanup EXIT

# A loopback port that was free a moment ago.
free_port() {
    python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'
}

# Starts a redis-server without persistence on loopback, in the background, and waits until it
# answers. $1: port, $2: its directory (made), rest: extra arguments.
start_redis() {
    local port=$1 dir=$2; shift 2
    mkdir -p "$dir"
    redis-server --port "$port" --bind 127.0.0.1 --save "" --appendonly no --dir "$dir" \
        --daemonize yes --logfile "$dir/redis.log" "$@" >/dev/null
    ports+=("$port")
    until redis-cli -p "$port" ping >/dev/null 2>&1; do sleep 0.01; done
}
