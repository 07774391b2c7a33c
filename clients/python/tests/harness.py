"""Real processes for the client's tests: a ``lockbroker serve`` built from this repository, a
``redis-server`` on a free loopback port, and a recording HTTP proxy between client and broker
that can lose an answer on purpose. Nothing is mocked: the client talks HTTP to the real broker.

The broker binary is ``$LOCKBROKER_BIN``, else the repository's ``target/debug/lockbroker``
(``cargo build --bin lockbroker`` makes it).
"""

import http.client
import json
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

REPO = pathlib.Path(__file__).resolve().parents[3]

#: How long a process gets to come up.
START_LIMIT = 10.0


def broker_binary() -> pathlib.Path:
    path = pathlib.Path(os.environ.get("LOCKBROKER_BIN", REPO / "target" / "debug" / "lockbroker"))
    if not path.is_file():
        raise RuntimeError(
            f"no lockbroker binary at {path}: build it with `cargo build --bin lockbroker`, "
            "or point LOCKBROKER_BIN at one"
        )
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(predicate: Callable[[], Any], timeout: float, what: str, every: float = 0.02) -> Any:
    """Polls ``predicate`` until it returns something truthy; fails after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(every)


def threads_since(before: "set[threading.Thread]") -> List[threading.Thread]:
    """The threads alive now that were not in ``before`` (``set(threading.enumerate())``): in a
    process that other tests' threads leave and enter, what a count cannot tell."""
    return [t for t in threading.enumerate() if t not in before]


def lost_signal(lease: Any) -> threading.Event:
    """An event set when ``lease`` (a ``Lease`` or an ``AsyncLease``) is lost."""
    fired = threading.Event()
    lease.on_lost(fired.set)
    return fired


def hold_first_answer(proxy: "Proxy", method: str, path: str
                      ) -> Tuple[threading.Event, threading.Event]:
    """Makes ``proxy`` hold back the broker's answer to the first ``method path`` until
    ``resume`` is set, then lose it (the broker acted; the client cannot know). Returns
    (``held``: set once that answer is held, ``resume``)."""
    held = threading.Event()
    resume = threading.Event()

    def hold(exchange: "Exchange") -> bool:
        if exchange.method == method and exchange.path == path and not held.is_set():
            held.set()
            resume.wait(10)
            return True
        return False

    proxy.drop = hold
    return held, resume


def http_call(
    base: str,
    method: str,
    path: str,
    headers: Optional[Dict[str, str]] = None,
    timeout: float = 10.0,
) -> Tuple[int, Any]:
    """One raw request (not through the client under test): status and decoded body."""
    host, port = base.replace("http://", "").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        conn.request(method, path, headers=headers or {})
        response = conn.getresponse()
        raw = response.read()
    finally:
        conn.close()
    try:
        body = json.loads(raw) if raw else None
    except ValueError:
        body = raw.decode("utf-8", "replace")
    return response.status, body


class RedisServer:
    """A ``redis-server`` of the test's own on a free loopback port, without persistence."""

    def __init__(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="lockbroker-py-redis-")
        self.port = 0
        self.proc: Optional[subprocess.Popen] = None
        for _ in range(10):
            self.port = free_port()
            if self._launch():
                return
        raise RuntimeError("redis-server did not start on any free port (is redis-server on PATH?)")

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/"

    def _launch(self) -> bool:
        log = open(os.path.join(self.dir, "redis.log"), "ab")
        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", self.dir],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        )
        log.close()
        deadline = time.monotonic() + START_LIMIT
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return False  # most likely the port was taken meanwhile
            if self._pings():
                return True
            time.sleep(0.02)
        self.stop()
        with open(os.path.join(self.dir, "redis.log"), errors="replace") as f:
            log = f.read()
        raise RuntimeError(f"redis-server on port {self.port} did not answer PING:\n{log}")

    def _pings(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def stop(self) -> None:
        """Kills the server: its data is gone, as with a Redis that crashed."""
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None

    def restart(self) -> None:
        """An empty server again on the same port (retried while the old port is busy)."""
        self.stop()
        deadline = time.monotonic() + START_LIMIT
        while not self._launch():
            if time.monotonic() >= deadline:
                raise RuntimeError(f"port {self.port} stayed busy; cannot restart redis")
            time.sleep(0.05)

    def pause(self) -> None:
        """SIGSTOP: connections stay open, nothing is answered (a Redis stuck, a network that
        drops packets). What was sent meanwhile runs after :meth:`resume`."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)

    def close(self) -> None:
        if self.proc is not None:
            self.resume()
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


class BrokerProcess:
    """``lockbroker serve`` on a port it picks itself (``--listen 127.0.0.1:0``; the port is
    read from its start-up log line), in a process group of its own."""

    def __init__(self, redis_url: Optional[str] = None, extra: Tuple[str, ...] = ()) -> None:
        self.log_path = tempfile.mktemp(prefix="lockbroker-py-broker-", suffix=".log")
        self._args = ["--log-format", "json", "--log-level", "info", "--allow-force-release",
                      "--store-timeout-ms", "500", "--store-settle-ms", "500"]
        if redis_url is not None:
            self._args += ["--redis-url", redis_url]
        self._args += list(extra)
        self._start("127.0.0.1:0")

    def _start(self, listen: str) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("LOCKBROKER_")}
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [str(broker_binary()), "serve", "--listen", listen] + self._args,
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                start_new_session=True)
        self.url = "http://" + wait_until(self._serving_addr, START_LIMIT, "the broker to serve")
        wait_until(lambda: self.call("GET", "/readyz")[0] == 200, START_LIMIT,
                   "the broker to be ready")

    def restart(self) -> None:
        """Starts the broker again on the same port (after :meth:`kill` or :meth:`terminate`),
        retrying while the port is still busy."""
        self.kill()
        listen = self.url.replace("http://", "")
        deadline = time.monotonic() + START_LIMIT
        while True:
            try:
                self._start(listen)
                return
            except RuntimeError:
                if time.monotonic() >= deadline:
                    raise
                time.sleep(0.05)

    def terminate(self) -> None:
        """SIGTERM, as an orchestrator stops a broker: waiting requests are answered
        ``503 shutting_down``; waits for the exit."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=START_LIMIT)

    def _serving_addr(self) -> Optional[str]:
        if self.proc.poll() is not None:
            raise RuntimeError(f"the broker exited at start:\n{self.log()}")
        for line in self.log().splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue
            fields = record.get("fields", {})
            if fields.get("message") == "lockbroker is serving":
                return fields["addr"]
        return None

    def log(self) -> str:
        with open(self.log_path, encoding="utf-8", errors="replace") as f:
            return f.read()

    def call(self, method: str, path: str, headers: Optional[Dict[str, str]] = None) -> Tuple[int, Any]:
        return http_call(self.url, method, path, headers)

    def holders(self, key: str, space: str = "locks") -> List[Dict[str, Any]]:
        """The leases on ``key`` as the broker shows them (one for an exclusive lock)."""
        status, body = self.call("GET", f"/{space}/{key}")
        if status == 404:
            return []
        assert status == 200, (status, body)
        return body.get("holders") or [body]

    def metric(self, name: str, label: str = "") -> float:
        """The sum of the series of a metric in ``/metrics`` (those with ``label``, such as
        ``space="semaphores"``, if given)."""
        status, text = self.call("GET", "/metrics")
        assert status == 200
        total = 0.0
        for line in text.splitlines():
            if (line.startswith(name + "{") or line.startswith(name + " ")) and label in line:
                total += float(line.rsplit(" ", 1)[1])
        return total

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def close(self) -> None:
        self.kill()
        try:
            os.unlink(self.log_path)
        except OSError:
            pass


class Exchange:
    """One request the proxy relayed, and what it did with the answer."""

    def __init__(self, method: str, path: str, body: bytes) -> None:
        self.method = method
        self.path = path
        self.body = body
        self.status: Optional[int] = None
        self.answer: Any = None
        self.dropped = False

    def json(self) -> Dict[str, Any]:
        return json.loads(self.body) if self.body else {}


class Proxy:
    """An HTTP/1.1 proxy in front of a broker, on a loopback port: it records every exchange,
    closes the client's connection instead of answering when :attr:`drop` says so (the request
    still reaches the broker, whose answer is lost on the way back), and answers a status of
    its own without forwarding when :attr:`refuse` gives one."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream.replace("http://", "")
        self.exchanges: List[Exchange] = []
        self.drop: Callable[[Exchange], bool] = lambda exchange: False
        #: A status to answer instead of forwarding the request (a load balancer whose broker
        #: did not answer), or None to forward it.
        self.refuse: Callable[[Exchange], Optional[int]] = lambda exchange: None
        self._cond = threading.Condition()
        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(64)
        self.url = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def wait_for(self, predicate: Callable[[Exchange], bool], count: int = 1,
                 timeout: float = 10.0) -> List[Exchange]:
        """Waits until ``count`` relayed exchanges satisfy ``predicate``; returns them."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                matching = [e for e in self.exchanges if e.status is not None and predicate(e)]
                if len(matching) >= count:
                    return matching
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(
                        f"timed out waiting for {count} matching exchanges; saw "
                        f"{[(e.method, e.path, e.status) for e in self.exchanges]}")
                self._cond.wait(left)

    def seen(self, predicate: Callable[[Exchange], bool]) -> List[Exchange]:
        with self._cond:
            return [e for e in self.exchanges if predicate(e)]

    def close(self) -> None:
        self._closed = True
        self._sock.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        with client:
            reader = client.makefile("rb")
            while True:
                request_line = reader.readline()
                if not request_line:
                    return
                method, path, _ = request_line.decode("latin-1").split(" ", 2)
                headers: Dict[str, str] = {}
                while True:
                    line = reader.readline().decode("latin-1")
                    if line in ("\r\n", "\n", ""):
                        break
                    name, value = line.split(":", 1)
                    headers[name.strip()] = value.strip()
                length = int(next((v for k, v in headers.items() if k.lower() == "content-length"), "0"))
                body = reader.read(length) if length else b""
                exchange = Exchange(method, path, body)
                with self._cond:
                    self.exchanges.append(exchange)
                refused = self.refuse(exchange)
                if refused is not None:
                    raw = b'{"error": "bad_gateway", "message": "no broker answered"}'
                    with self._cond:
                        exchange.status = refused
                        exchange.answer = json.loads(raw)
                        self._cond.notify_all()
                    client.sendall(
                        f"HTTP/1.1 {refused} Refused\r\nContent-Type: application/json\r\n"
                        f"Content-Length: {len(raw)}\r\n\r\n".encode("latin-1") + raw)
                    continue
                forward = {k: v for k, v in headers.items()
                           if k.lower() not in ("host", "connection", "content-length")}
                host, port = self.upstream.split(":")
                upstream = http.client.HTTPConnection(host, int(port), timeout=120)
                try:
                    upstream.request(method, path, body=body or None, headers=forward)
                    response = upstream.getresponse()
                    raw = response.read()
                    answer_headers = [(k, v) for k, v in response.getheaders()
                                      if k.lower() not in ("connection", "content-length",
                                                           "transfer-encoding")]
                except OSError:
                    return  # the broker is gone: so is the client's answer
                finally:
                    upstream.close()
                dropped = self.drop(exchange)
                with self._cond:
                    exchange.status = response.status
                    exchange.answer = json.loads(raw) if raw.startswith(b"{") else None
                    exchange.dropped = dropped
                    self._cond.notify_all()
                if dropped:
                    return  # the answer is lost: the connection just closes
                head = f"HTTP/1.1 {response.status} {response.reason}\r\n"
                for k, v in answer_headers:
                    head += f"{k}: {v}\r\n"
                head += f"Content-Length: {len(raw)}\r\n\r\n"
                try:
                    client.sendall(head.encode("latin-1") + raw)
                except OSError:
                    return
