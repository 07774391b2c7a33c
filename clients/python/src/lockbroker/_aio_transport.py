"""HTTP/1.1 to one broker on asyncio, standard library only: ``asyncio.open_connection`` (TLS
through ``ssl`` for ``https://``), a pool of kept-alive connections (as many in flight at once
as there are requests: each waiting acquire holds one), and the same line between an answer and
no answer (:class:`~lockbroker._transport.NoAnswer`) as the sync transport.

No thread is used: a numeric host needs no name lookup, and a name is looked up once (on the
loop's default executor, which is the only way asyncio has) and the addresses kept until a
connection to them fails.
"""

import asyncio
import http.client
import io
import ipaddress
import json
import socket
import ssl
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

from ._transport import Answer, Endpoint, NoAnswer, decode_body, describe

#: How long a kept-alive connection may sit idle before it is dropped rather than reused (see
#: the sync transport).
_IDLE_LIMIT = 4.0

#: Most idle connections kept; more are closed after use.
_POOL_SIZE = 32

#: How long an ordered request waits for ``100 Continue`` before it sends its body anyway.
_CONTINUE_WAIT = 1.0

_Connection = Tuple[asyncio.StreamReader, asyncio.StreamWriter]


class AsyncTransport(Endpoint):
    """Requests to the broker at ``url`` from one event loop."""

    def __init__(self, url: str, bearer: Optional[str], ssl_context: Optional[ssl.SSLContext],
                 user_agent: str):
        super().__init__(url, bearer, ssl_context, user_agent)
        self._host_header = self._host if ":" not in self._host else f"[{self._host}]"
        if self._port != (443 if self._https else 80):
            self._host_header += f":{self._port}"
        try:
            ipaddress.ip_address(self._host)
            self._addresses: Optional[List[str]] = [self._host]
            self._numeric = True
        except ValueError:
            self._addresses = None
            self._numeric = False
        self._resolving: Optional["asyncio.Future[List[str]]"] = None
        self._idle: List[Tuple[_Connection, float]] = []
        self._closed = False
        # Per path, the ordered requests waiting to be sent or unanswered (see `request`).
        self._turns: Dict[str, _Turn] = {}

    async def request(
        self,
        method: str,
        path: str,
        *,
        timeout: float,
        body: Optional[Dict[str, Any]] = None,
        headers: Optional[Dict[str, str]] = None,
        ordered: bool = False,
        sending: Optional[Callable[[], None]] = None,
    ) -> Answer:
        """Sends one request and reads its answer within ``timeout`` seconds. Raises
        :class:`NoAnswer` when no HTTP answer came. Cancelled, it closes its connection: a
        waiting request ends at the broker with it.

        ``ordered`` (acquires): the broker serves waiters in the order their requests reached
        it, so ordered requests to one path leave in call order; while another one to the same
        path waits its turn or is unanswered, a request sends its head with ``Expect:
        100-continue``, its body after the broker's ``100 Continue`` (which comes when the
        broker's handler reads the body, just before it queues the request), and lets the next
        one go only then.

        ``sending``, if given, is called just before the request's first bytes are written:
        a request cancelled or failed before it (waiting its turn, connecting) cannot have
        reached the broker."""
        head, payload = self._encode(method, self._prefix + path, body, headers)
        timeout = max(timeout, 0.05)
        deadline = time.monotonic() + timeout
        if not ordered:
            conn, reused = await self._send(head + payload, deadline, sending)
            return await self._exchanged(conn, reused, method, head + payload, deadline)
        turn = self._turns.get(path)
        if turn is None:
            turn = self._turns[path] = _Turn()
        turn.users += 1
        try:
            async with turn.lock:
                if turn.users > 1 and payload:
                    sent = await self._send_in_turn(method, head, payload, deadline, sending)
                    if isinstance(sent, Answer):
                        return sent
                    conn, reused = sent
                else:
                    conn, reused = await self._send(head + payload, deadline, sending)
            return await self._exchanged(conn, reused, method, head + payload, deadline)
        finally:
            turn.users -= 1
            if turn.users == 0 and self._turns.get(path) is turn:
                del self._turns[path]

    async def _exchanged(self, conn: _Connection, reused: bool, method: str, data: bytes,
                         deadline: float) -> Answer:
        """The answer to a request sent on ``conn``."""
        try:
            return await self._receive(conn, reused, method, deadline)
        except _Stale:
            # A kept-alive connection the broker had closed: nothing was read, the request did
            # not count. Once more on a fresh connection.
            conn = await self._connect(deadline)
            await self._write(conn, data, False)
            try:
                return await self._receive(conn, False, method, deadline)
            except _Stale:
                raise NoAnswer("the broker closed the connection", sent=True) from None

    async def attempt(self, method: str, path: str, **request: Any) -> Tuple[Optional[Answer], str]:
        """As the sync transport's ``attempt``: :meth:`request`'s answer and ``""``, or ``None``
        and why no answer came (a cancellation still raises)."""
        try:
            return await self.request(method, path, **request), ""
        except NoAnswer as e:
            return None, str(e)

    async def close(self) -> None:
        self._closed = True
        idle, self._idle = self._idle, []
        for (_, writer), _ in idle:
            writer.close()

    # -- one exchange ---------------------------------------------------------------------------

    def _encode(self, method: str, target: str, body: Optional[Dict[str, Any]],
                headers: Optional[Dict[str, str]]) -> Tuple[bytes, bytes]:
        """The request's head (ending with its blank line) and body."""
        payload = json.dumps(body).encode("utf-8") if body is not None else b""
        lines = [f"{method} {target} HTTP/1.1", f"Host: {self._host_header}"]
        all_headers = dict(self._headers)
        if headers:
            all_headers.update(headers)
        if body is not None:
            all_headers["Content-Type"] = "application/json"
        if body is not None or method in ("POST", "PUT"):
            all_headers["Content-Length"] = str(len(payload))
        lines += [f"{name}: {value}" for name, value in all_headers.items()]
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1"), payload

    async def _send(self, data: bytes, deadline: float,
                    sending: Optional[Callable[[], None]]) -> Tuple[_Connection, bool]:
        conn = self._take()
        if conn is not None:
            if sending is not None:
                sending()
            try:
                await self._write(conn, data, True)
                return conn, True
            except _Stale:
                pass
        conn = await self._connect(deadline)
        if sending is not None:
            sending()
        await self._write(conn, data, False)
        return conn, False

    async def _send_in_turn(self, method: str, head: bytes, payload: bytes, deadline: float,
                            sending: Optional[Callable[[], None]]
                            ) -> "Tuple[_Connection, bool] | Answer":
        """Sends the head with ``Expect: 100-continue``, then the body once the broker said
        ``100 Continue`` (or did not within :data:`_CONTINUE_WAIT`: something in front that
        does not pass it on). A final answer instead of the 100 is returned as it is."""
        expecting = head[:-2] + b"Expect: 100-continue\r\n\r\n"
        conn = self._take()
        reused = conn is not None
        for _ in range(2):
            if conn is None:
                conn, reused = await self._connect(deadline), False
            if sending is not None:
                sending()
            try:
                await self._write(conn, expecting, reused)
                early = await self._await_continue(conn, reused, method, deadline)
            except _Stale:
                conn = None
                continue
            if early is not None:
                return early
            await self._write(conn, payload, False)
            return conn, reused
        raise NoAnswer("the broker closed the connection", sent=True)

    async def _await_continue(self, conn: _Connection, reused: bool, method: str,
                              deadline: float) -> Optional[Answer]:
        reader, writer = conn
        try:
            line = await asyncio.wait_for(
                reader.readline(), min(_CONTINUE_WAIT, max(deadline - time.monotonic(), 0.01)))
            if not line:
                raise _Stale()
            status = int(line.split(None, 2)[1])
            if 100 <= status < 200:
                while (await reader.readline()) not in (b"\r\n", b"\n", b""):
                    pass
                return None
            # Answered before the body was read (a refusal): that is the answer.
            status, headers, raw, _ = await asyncio.wait_for(
                self._read_answer(reader, method, line), max(deadline - time.monotonic(), 0.01))
        except asyncio.TimeoutError:
            return None
        except _Stale:
            writer.close()
            if reused:
                raise
            raise NoAnswer("the broker closed the connection", sent=True) from None
        except (OSError, ValueError, IndexError, asyncio.IncompleteReadError) as e:
            writer.close()
            if reused and isinstance(e, ConnectionResetError):
                raise _Stale() from e
            raise NoAnswer(describe(e), sent=True) from None
        except BaseException:
            writer.close()
            raise
        writer.close()  # the body it did not read would be taken for the next request
        return Answer(status, headers, decode_body(raw))

    async def _write(self, conn: _Connection, data: bytes, reused: bool) -> None:
        writer = conn[1]
        try:
            writer.write(data)
            await writer.drain()
        except (ConnectionResetError, BrokenPipeError) as e:
            writer.close()
            if reused:
                raise _Stale() from e
            raise NoAnswer(describe(e), sent=True) from None
        except OSError as e:
            writer.close()
            raise NoAnswer(describe(e), sent=True) from None
        except BaseException:
            writer.close()
            raise

    async def _receive(self, conn: _Connection, reused: bool, method: str,
                       deadline: float) -> Answer:
        reader, writer = conn
        try:
            status, headers, raw, keep = await asyncio.wait_for(
                self._read_answer(reader, method), max(deadline - time.monotonic(), 0.01))
        except _Stale:
            writer.close()
            if reused:
                raise
            raise NoAnswer("the broker closed the connection", sent=True) from None
        except asyncio.TimeoutError:
            writer.close()
            raise NoAnswer("the broker did not answer in time", sent=True) from None
        except ConnectionResetError as e:
            writer.close()
            if reused:
                raise _Stale() from e
            raise NoAnswer(describe(e), sent=True) from None
        except (OSError, ValueError, asyncio.IncompleteReadError, asyncio.LimitOverrunError) as e:
            writer.close()
            raise NoAnswer(describe(e), sent=True) from None
        except BaseException:
            # Cancelled: the connection goes, and with it a waiting request at the broker.
            writer.close()
            raise
        if keep:
            self._give_back(conn)
        else:
            writer.close()
        return Answer(status, headers, decode_body(raw))

    @staticmethod
    async def _read_answer(reader: asyncio.StreamReader, method: str, line: bytes = b""
                           ) -> Tuple[int, http.client.HTTPMessage, bytes, bool]:
        """The answer's status, headers, body and whether the connection may be kept; ``line``:
        its status line, if read already. Interim (1xx) answers are skipped."""
        while True:
            line = line or await reader.readline()
            if not line:
                raise _Stale()
            parts = line.decode("latin-1").split(None, 2)
            if len(parts) < 2 or not parts[0].startswith("HTTP/"):
                raise ValueError(f"not an HTTP answer: {line[:40]!r}")
            version, status = parts[0], int(parts[1])
            head = b""
            while True:
                header = await reader.readline()
                if header in (b"\r\n", b"\n", b""):
                    break
                head += header
            if not 100 <= status < 200:
                break
            line = b""
        headers = http.client.parse_headers(io.BytesIO(head + b"\r\n"))
        keep = version != "HTTP/1.0" and \
            (headers.get("Connection") or "").strip().lower() != "close"
        if method == "HEAD" or status in (204, 304):
            return status, headers, b"", keep
        if (headers.get("Transfer-Encoding") or "").strip().lower() == "chunked":
            raw = b""
            while True:
                size = int((await reader.readline()).split(b";")[0].strip(), 16)
                if size == 0:
                    while (await reader.readline()) not in (b"\r\n", b"\n", b""):
                        pass
                    break
                raw += await reader.readexactly(size)
                await reader.readexactly(2)
            return status, headers, raw, keep
        length = headers.get("Content-Length")
        if length is not None:
            return status, headers, await reader.readexactly(int(length)), keep
        return status, headers, await reader.read(), False

    # -- connections ----------------------------------------------------------------------------

    def _take(self) -> Optional[_Connection]:
        now = time.monotonic()
        while self._idle:
            conn, since = self._idle.pop()
            if now - since < _IDLE_LIMIT and not conn[0].at_eof():
                return conn
            conn[1].close()
        return None

    def _give_back(self, conn: _Connection) -> None:
        if not self._closed and len(self._idle) < _POOL_SIZE:
            self._idle.append((conn, time.monotonic()))
        else:
            conn[1].close()

    async def _connect(self, deadline: float) -> _Connection:
        addresses = await self._resolve(deadline)
        problem: Optional[BaseException] = None
        for address in addresses:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                conn = await asyncio.wait_for(
                    asyncio.open_connection(
                        address, self._port, ssl=self._ssl_context,
                        server_hostname=self._host if self._https else None),
                    left)
            except asyncio.TimeoutError:
                problem = socket.timeout("timed out")
            except (OSError, ssl.SSLError) as e:
                problem = e
            else:
                if address != addresses[0] and self._addresses is addresses:
                    # The one that answered first from now on (localhost: ::1 refused, then
                    # 127.0.0.1).
                    self._addresses = [address] + [a for a in addresses if a != address]
                return conn
        if not self._numeric:
            self._addresses = None  # looked up again next time: the name may point elsewhere now
        raise NoAnswer(describe(problem) if problem else "the broker did not answer in time",
                       sent=False)

    async def _resolve(self, deadline: float) -> List[str]:
        if self._addresses is not None:
            return self._addresses
        if self._resolving is None or self._resolving.done():
            self._resolving = asyncio.ensure_future(self._look_up())
        try:
            # Shielded: one caller's cancellation does not cancel the others' lookup.
            return await asyncio.wait_for(asyncio.shield(self._resolving),
                                          max(deadline - time.monotonic(), 0.01))
        except asyncio.TimeoutError:
            raise NoAnswer(f"looking up {self._host} took too long", sent=False) from None
        except OSError as e:
            raise NoAnswer(f"cannot look up {self._host}: {e}", sent=False) from None

    async def _look_up(self) -> List[str]:
        infos = await asyncio.get_running_loop().getaddrinfo(
            self._host, self._port, type=socket.SOCK_STREAM)
        addresses: List[str] = []
        for info in infos:
            address = str(info[4][0])
            if address not in addresses:
                addresses.append(address)
        self._addresses = addresses
        return addresses


class _Turn:
    """The ordered requests to one path: a lock held while one is sent, and how many are
    waiting for it or unanswered."""

    __slots__ = ("lock", "users")

    def __init__(self) -> None:
        self.lock = asyncio.Lock()
        self.users = 0


class _Stale(Exception):
    """A pooled connection was found closed by the broker."""
