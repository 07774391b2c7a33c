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
from typing import Any, Dict, List, Optional, Tuple

from ._transport import Answer, Endpoint, NoAnswer, decode_body, describe

#: How long a kept-alive connection may sit idle before it is dropped rather than reused (see
#: the sync transport).
_IDLE_LIMIT = 4.0

#: Most idle connections kept; more are closed after use.
_POOL_SIZE = 32

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
        # Held while an ordered request connects and writes: acquires leave in call order.
        self._order: Optional[asyncio.Lock] = None

    async def request(
        self,
        method: str,
        path: str,
        *,
        timeout: float,
        body: Optional[Dict[str, Any]] = None,
        headers: Optional[Dict[str, str]] = None,
        ordered: bool = False,
    ) -> Answer:
        """Sends one request and reads its answer within ``timeout`` seconds. Raises
        :class:`NoAnswer` when no HTTP answer came. ``ordered``: sent only after every earlier
        ordered request was written (the broker serves waiting acquires in arrival order).
        Cancelled, it closes its connection: a waiting request ends at the broker with it."""
        data = self._encode(method, self._prefix + path, body, headers)
        timeout = max(timeout, 0.05)
        deadline = time.monotonic() + timeout
        if ordered:
            if self._order is None:
                self._order = asyncio.Lock()
            async with self._order:
                conn, reused = await self._send(data, deadline)
        else:
            conn, reused = await self._send(data, deadline)
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

    async def close(self) -> None:
        self._closed = True
        idle, self._idle = self._idle, []
        for (_, writer), _ in idle:
            writer.close()

    # -- one exchange ---------------------------------------------------------------------------

    def _encode(self, method: str, target: str, body: Optional[Dict[str, Any]],
                headers: Optional[Dict[str, str]]) -> bytes:
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
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + payload

    async def _send(self, data: bytes, deadline: float) -> Tuple[_Connection, bool]:
        conn = self._take()
        if conn is not None:
            try:
                await self._write(conn, data, True)
                return conn, True
            except _Stale:
                pass
        conn = await self._connect(deadline)
        await self._write(conn, data, False)
        return conn, False

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
    async def _read_answer(reader: asyncio.StreamReader,
                           method: str) -> Tuple[int, http.client.HTTPMessage, bytes, bool]:
        line = await reader.readline()
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
        headers = http.client.parse_headers(io.BytesIO(head + b"\r\n"))
        keep = version != "HTTP/1.0" and \
            (headers.get("Connection") or "").strip().lower() != "close"
        if method == "HEAD" or status in (204, 304) or 100 <= status < 200:
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
                return await asyncio.wait_for(
                    asyncio.open_connection(
                        address, self._port, ssl=self._ssl_context,
                        server_hostname=self._host if self._https else None),
                    left)
            except asyncio.TimeoutError:
                problem = socket.timeout("timed out")
            except (OSError, ssl.SSLError) as e:
                problem = e
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


class _Stale(Exception):
    """A pooled connection was found closed by the broker."""
