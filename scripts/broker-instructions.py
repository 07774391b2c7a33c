#!/usr/bin/env python3
"""Counts a broker's user-space instructions per lock cycle, with valgrind's callgrind.

    scripts/broker-instructions.py BINARY [REDIS_URL] [--cycles 1000]

Starts `BINARY serve` on a free loopback port under `valgrind --tool=callgrind
--instr-atstart=no` with one tokio worker (TOKIO_WORKER_THREADS=1: no work-stealing between
threads that valgrind runs one at a time anyway, so two runs agree to about 0.2%), on the
embedded store or on the Redis at REDIS_URL. One keep-alive HTTP/1.1 connection runs 200
acquire+release cycles on one key to warm up; then instrumentation is turned on
(`callgrind_control -i on PID`), CYCLES more run, the counts are dumped (`callgrind_control -d
PID`, by pid: without one it reaches every callgrind run on the machine) and the dump's total
is divided by CYCLES. Counts, unlike timings, do not move with the machine's load: two builds
are compared by running this on each (see docs/benchmarks.md). Stops the broker by itself.
"""
import argparse
import glob
import http.client
import os
import shutil
import socket
import subprocess
import tempfile
import time


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("binary")
    parser.add_argument("redis_url", nargs="?")
    parser.add_argument("--cycles", type=int, default=1000)
    args = parser.parse_args()
    port = free_port()
    work = tempfile.mkdtemp(prefix="broker-instructions-")
    out = os.path.join(work, "callgrind.out")
    command = ["valgrind", "--tool=callgrind", "--instr-atstart=no",
               f"--callgrind-out-file={out}", args.binary, "serve",
               "--listen", f"127.0.0.1:{port}"]
    if args.redis_url:
        command += ["--redis-url", args.redis_url, "--store-settle-ms", "0"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("LOCKBROKER_")}
    env["TOKIO_WORKER_THREADS"] = "1"
    with open(os.path.join(work, "broker.log"), "w") as log:
        broker = subprocess.Popen(command, env=env, stdout=log, stderr=log)
    try:
        deadline = time.time() + 120
        while True:
            try:
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
                conn.request("GET", "/readyz")
                answer = conn.getresponse()
                answer.read()
                if answer.status == 200:
                    break
            except OSError:
                pass
            if broker.poll() is not None or time.time() > deadline:
                raise SystemExit(open(os.path.join(work, "broker.log")).read())
            time.sleep(0.2)

        def cycles(n):
            for _ in range(n):
                conn.request("POST", "/locks/k", headers={"Content-Length": "0"})
                answer = conn.getresponse()
                body = answer.read()
                assert answer.status == 201, (answer.status, body)
                token = body.split(b'"token":"')[1].split(b'"')[0].decode()
                conn.request("DELETE", "/locks/k", headers={"Lock-Token": token})
                answer = conn.getresponse()
                body = answer.read()
                assert answer.status == 204, (answer.status, body)

        cycles(200)
        subprocess.run(["callgrind_control", "-i", "on", str(broker.pid)],
                       check=True, capture_output=True)
        cycles(args.cycles)
        subprocess.run(["callgrind_control", "-d", str(broker.pid)],
                       check=True, capture_output=True)
        for _ in range(100):
            dumps = sorted(glob.glob(out + ".*"))
            if dumps:
                break
            time.sleep(0.1)
        dump = dumps[0]
        with open(dump) as f:
            total = next(int(line.split()[1]) for line in f
                         if line.startswith(("summary:", "totals:")))
        store = "Redis" if args.redis_url else "embedded store"
        print(f"{args.binary} ({store}): {total / args.cycles:,.0f} instructions per cycle "
              f"({total:,} for {args.cycles:,} cycles)")
    finally:
        broker.terminate()
        broker.wait()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
