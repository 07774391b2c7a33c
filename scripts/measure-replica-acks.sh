#!/usr/bin/env bash
# What replica acknowledgements cost: `lockbroker-bench` against a release-build broker on a
# Redis master whose one replica sits behind a link that delays every byte by 1 ms each way
# (a replica in another zone), once with --redis-replica-acks 0 and once with 1, and prints both
# tables (requests/s and latency percentiles of each phase).
#
#   scripts/measure-replica-acks.sh [delay_ms (default 1)] [extra bench flags, e.g. --duration 5s]
#
# The delaying link is a small Python proxy on loopback between the replica and the master (the
# replication stream, and the acknowledgements WAIT asks for, both cross it). Needs
# redis-server, redis-cli, python3 and curl. Everything binds 127.0.0.1 and stops by itself.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
delay_ms=${1:-1}
shift || true
# shellcheck source=scripts/common.sh
source scripts/common.sh


master=$(free_port)
start_redis "$master" "$work/master" --repl-diskless-sync-delay 0
link=$(free_port)
# The delaying link: every chunk is forwarded delay_ms after it arrived, in order, both ways.
python3 - "$link" "$master" "$delay_ms" >"$work/proxy.log" 2>&1 <<'PY' &
import asyncio, sys
listen, upstream, delay = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]) / 1000

async def pipe(reader, writer):
    loop = asyncio.get_running_loop()
    queue = asyncio.Queue()
    async def send():
        while True:
            due, data = await queue.get()
            if data is None:
                writer.close()
                return
            wait = due - loop.time()
            if wait > 0:
                await asyncio.sleep(wait)
            writer.write(data)
            await writer.drain()
    sender = asyncio.ensure_future(send())
    while True:
        data = await reader.read(65536)
        await queue.put((loop.time() + delay, data or None))
        if not data:
            break
    await sender

async def serve(client_reader, client_writer):
    server_reader, server_writer = await asyncio.open_connection("127.0.0.1", upstream)
    await asyncio.gather(pipe(client_reader, server_writer), pipe(server_reader, client_writer))

async def main():
    server = await asyncio.start_server(serve, "127.0.0.1", listen)
    async with server:
        await server.serve_forever()

asyncio.run(main())
PY
pids+=($!)
until python3 -c "import socket; socket.create_connection(('127.0.0.1',$link))" 2>/dev/null; do sleep 0.05; done
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
