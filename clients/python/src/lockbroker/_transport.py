"""HTTP to one broker: a small pool of kept-alive connections, JSON in and out, and the line
between an answer (any status) and no answer (:class:`NoAnswer`). What a status means is the
caller's business; this module never retries a request on its own, except once on a fresh
connection when a pooled one turns out to have been closed while it sat idle."""

import http.client
import json
import socket
import ssl
import threading
import time
import urllib.parse
from typing import Any, Dict, List, NamedTuple, Optional, Tuple, TypeVar

#: How long a kept-alive connection may sit idle before it is dropped rather than reused. The
#: broker disconnects a connection idle for its header timeout (10 s by default); dropping ours
#: well before keeps a request from meeting a connection the broker is closing.
_IDLE_LIMIT = 4.0

#: Most idle connections kept; more are closed after use.
_POOL_SIZE = 8


class NoAnswer(Exception):
    """No HTTP answer came: the connection could not be made, broke, or timed out.

    ``sent`` says whether the request may have reached the broker (then the broker may have acted
    on it); the message names the cause, never a token.
    """

    def __init__(self, message: str, *, sent: bool):
        super().__init__(message)
        self.sent = sent


#: Statuses that mean "try again": the broker's own ``503``, the ``502``/``504`` of a load
#: balancer in front of brokers that did not answer it (the request may have reached one, which
#: is why every repeat carries the same ``request_id``), and a ``429`` of a rate limiter in front.
#: Any other ``5xx`` (the broker itself never answers one) is an error at once.
RETRYABLE = frozenset({429, 502, 503, 504})


class Target(NamedTuple):
    """Where a broker is: scheme, host, port and path prefix, from its URL."""

    https: bool
    host: str
    port: int
    prefix: str


def parse_url(url: str) -> Target:
    """The broker's ``http[s]://HOST[:PORT][/PREFIX]`` URL, checked; ``ValueError`` otherwise."""
    if not isinstance(url, str):
        raise TypeError(f"the broker URL is a str, not {type(url).__name__}")
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"the broker URL must be http://HOST[:PORT] or https://...; got {url!r}")
    if parts.username or parts.password:
        raise ValueError("the broker URL must not carry credentials; pass token= instead")
    https = parts.scheme == "https"
    try:
        port = parts.port or (443 if https else 80)
    except ValueError as e:  # a port that is not a number, or out of range
        raise ValueError(f"bad port in the broker URL {url!r}") from e
    return Target(https, parts.hostname, port, parts.path.rstrip("/"))


def base_headers(bearer: Optional[str], user_agent: str) -> Dict[str, str]:
    headers = {"Accept": "application/json", "User-Agent": user_agent}
    if bearer is not None:
        headers["Authorization"] = f"Bearer {bearer}"
    return headers


def decode_body(raw: bytes) -> Dict[str, Any]:
    """A JSON object body, or ``{}`` for anything else (no body, not JSON, not an object)."""
    try:
        decoded = json.loads(raw.decode("utf-8")) if raw else {}
    except (UnicodeDecodeError, ValueError):
        return {}
    return decoded if isinstance(decoded, dict) else {}


class Answer:
    """A broker's answer: the status, the headers and the JSON body (``{}`` when there is none)."""

    __slots__ = ("status", "headers", "body")

    def __init__(self, status: int, headers: http.client.HTTPMessage, body: Dict[str, Any]):
        self.status = status
        self.headers = headers
        self.body = body

    @property
    def code(self) -> Optional[str]:
        """The broker's error code (``locked``, ``not_held``, ...), if the body has one."""
        code = self.body.get("error")
        return code if isinstance(code, str) else None

    @property
    def message(self) -> str:
        message = self.body.get("message")
        return message if isinstance(message, str) else f"HTTP {self.status}"

    def retry_after(self) -> Optional[float]:
        """Seconds the broker asked the client to wait: the body's ``retry_after_ms`` when given
        (exact), else the ``Retry-After`` header (whole seconds)."""
        ms = self.body.get("retry_after_ms")
        if isinstance(ms, int) and ms >= 0:
            return ms / 1000.0
        header = self.headers.get("Retry-After")
        if header is not None:
            try:
                return max(0.0, float(int(header.strip())))
            except ValueError:
                return None  # an HTTP date: not something the broker sends
        return None


_C = TypeVar("_C", bound="ClosedOnExit")


class ClosedOnExit:
    """An object a ``with`` block closes at its end (a Broker, a Leadership, a Follower)."""

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self: _C) -> _C:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class Endpoint:
    """What both transports know of the broker at ``url`` (which may carry a path prefix: a
    broker behind a reverse proxy under ``/lockbroker``): host, port, TLS, the headers of every
    request."""

    def __init__(
        self,
        url: str,
        bearer: Optional[str],
        ssl_context: Optional[ssl.SSLContext],
        user_agent: str,
    ):
        target = parse_url(url)
        self.url = url
        self._https = target.https
        self._host = target.host
        self._port = target.port
        self._prefix = target.prefix
        self._ssl_context = ssl_context
        if self._https and self._ssl_context is None:
            self._ssl_context = ssl.create_default_context()
        self._headers = base_headers(bearer, user_agent)


class Transport(Endpoint):
    """Requests to the broker at ``url``, thread-safe."""

    def __init__(self, url: str, bearer: Optional[str], ssl_context: Optional[ssl.SSLContext],
                 user_agent: str):
        super().__init__(url, bearer, ssl_context, user_agent)
        self._idle: List[Tuple[http.client.HTTPConnection, float]] = []
        self._lock = threading.Lock()
        self._closed = False

    def request(
        self,
        method: str,
        path: str,
        *,
        timeout: float,
        body: Optional[Dict[str, Any]] = None,
        headers: Optional[Dict[str, str]] = None,
    ) -> Answer:
        """Sends one request and reads its answer within ``timeout`` seconds of silence.

        Raises :class:`NoAnswer` when no HTTP answer came.
        """
        all_headers = dict(self._headers)
        if headers:
            all_headers.update(headers)
        payload = None
        if body is not None:
            payload = json.dumps(body).encode("utf-8")
            all_headers["Content-Type"] = "application/json"
        target = self._prefix + path
        timeout = max(timeout, 0.05)
        conn = self._take(timeout)
        try:
            return self._exchange(conn, method, target, payload, all_headers, timeout)
        except _Stale:
            # A kept-alive connection the broker had closed: nothing was read, the request did
            # not count. Once more on a fresh connection.
            conn = self._connect(timeout)
            try:
                return self._exchange(conn, method, target, payload, all_headers, timeout)
            except _Stale as e:
                raise NoAnswer(f"the broker closed the connection ({e.__cause__})", sent=True) from None

    def attempt(self, method: str, path: str, **request: Any) -> Tuple[Optional[Answer], str]:
        """:meth:`request`'s answer and ``""``, or ``None`` and why no answer came."""
        try:
            return self.request(method, path, **request), ""
        except NoAnswer as e:
            return None, str(e)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for conn, _ in idle:
            conn.close()

    def _exchange(
        self,
        conn: http.client.HTTPConnection,
        method: str,
        target: str,
        payload: Optional[bytes],
        headers: Dict[str, str],
        timeout: float,
    ) -> Answer:
        fresh = conn.sock is None
        sent = False
        try:
            if fresh:
                conn.connect()
            conn.sock.settimeout(timeout)
            conn.request(method, target, body=payload, headers=headers)
            sent = True
            response = conn.getresponse()
            raw = response.read()
        except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError) as e:
            conn.close()
            if not fresh:
                raise _Stale() from e
            raise NoAnswer(describe(e), sent=sent) from None
        except (OSError, http.client.HTTPException) as e:
            conn.close()
            raise NoAnswer(describe(e), sent=sent) from None
        if response.will_close:
            conn.close()
        else:
            self._give_back(conn)
        return Answer(response.status, response.headers, decode_body(raw))

    def _take(self, timeout: float) -> http.client.HTTPConnection:
        now = time.monotonic()
        with self._lock:
            while self._idle:
                conn, since = self._idle.pop()
                if now - since < _IDLE_LIMIT:
                    return conn
                conn.close()
        return self._connect(timeout)

    def _connect(self, timeout: float) -> http.client.HTTPConnection:
        # Not connected yet: `_exchange` connects, so that a refused connection is reported as
        # "not sent".
        if self._https:
            return http.client.HTTPSConnection(
                self._host, self._port, timeout=timeout, context=self._ssl_context
            )
        return http.client.HTTPConnection(self._host, self._port, timeout=timeout)

    def _give_back(self, conn: http.client.HTTPConnection) -> None:
        with self._lock:
            if not self._closed and len(self._idle) < _POOL_SIZE:
                self._idle.append((conn, time.monotonic()))
                return
        conn.close()


class _Stale(Exception):
    """A pooled connection was found closed by the broker."""


def describe(e: BaseException) -> str:
    """What a connection failure means, in words (never a token)."""
    if isinstance(e, (socket.timeout, TimeoutError)):
        return "the broker did not answer in time"
    if isinstance(e, ConnectionRefusedError):
        return "the broker refused the connection (is it running?)"
    text = str(e) or type(e).__name__
    return f"cannot reach the broker: {text}"
