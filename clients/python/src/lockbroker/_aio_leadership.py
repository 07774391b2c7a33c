"""Leader election for the asyncio client: :class:`AsyncLeadership`, what
:class:`~lockbroker.Leadership` is, as tasks on the loop. One task campaigns and runs the
callbacks (awaiting coroutine ones), so they never overlap and a revocation is always over
before the next campaign begins; another follows the key with a watch, so that every node knows
who leads. Closing a candidate that waits cancels its acquire, which leaves nothing behind."""

import asyncio
import inspect
import logging
from typing import TYPE_CHECKING, Any, Callable, List, Optional

from ._calls import inspect_request
from ._errors import BrokerError, Locked, Unavailable
from ._leadership import check_campaign, check_look
from ._lease_state import Backoff, _takes_an_argument
from ._transport import NoAnswer
from ._watch import KeyView

if TYPE_CHECKING:
    from .aio import AsyncBroker, AsyncLease

log = logging.getLogger("lockbroker")


class AsyncLeadership:
    """Campaigns for the lock ``key`` as ``name`` with leases of ``ttl`` seconds, from
    ``async with`` (or ``await start()``) until ``await close()``; each campaign's acquire
    waits up to ``part`` seconds, then the next begins. ``is_leader()``, ``leader()``,
    ``lease``, ``error``, ``on_elected`` and ``on_revoked`` as in
    :class:`~lockbroker.Leadership`; callbacks may be plain functions or coroutine functions
    (awaited on the campaign task). ``start`` raises the :class:`BrokerError` of a wrong token
    (401) or one without rights to the key (403); a refusal later stops the campaign (see
    ``error``)."""

    def __init__(self, client: "AsyncBroker", key: str, name: str, ttl: float = 10.0, *,
                 part: float = 5.0):
        check_campaign(ttl, part, name)
        inspect_request(client.url, key, False)  # a bad key: ValueError now
        self.key = key
        self.name = name
        self.ttl = float(ttl)
        self._client = client
        self._part = float(part)
        self._closed = False
        self._lease: Optional["AsyncLease"] = None
        self._view: Optional[KeyView] = None
        self._error: Optional[BrokerError] = None
        self._elected: List[Callable[..., Any]] = []
        self._revoked: List[Callable[..., Any]] = []
        self._wake: Optional[asyncio.Event] = None
        self._campaigner: Optional["asyncio.Task[None]"] = None
        self._watcher: Optional["asyncio.Task[None]"] = None
        self._waiting = False

    # -- what the application sees ------------------------------------------------------------

    def is_leader(self) -> bool:
        lease = None if self._closed else self._lease
        return lease is not None and lease.held

    def leader(self) -> Optional[str]:
        if self.is_leader():
            return self.name
        return self._view.owner if self._view is not None else None

    @property
    def lease(self) -> Optional["AsyncLease"]:
        return self._lease

    @property
    def error(self) -> Optional[BrokerError]:
        return self._error

    def on_elected(self, callback: Callable[..., Any]) -> None:
        """Runs ``callback`` each time this node becomes leader (registered while leading, at
        the next election)."""
        if not callable(callback):
            raise TypeError("on_elected takes a callable")
        self._elected.append(callback)

    def on_revoked(self, callback: Callable[..., Any]) -> None:
        if not callable(callback):
            raise TypeError("on_revoked takes a callable")
        self._revoked.append(callback)

    async def start(self) -> "AsyncLeadership":
        """Looks at the key once (raising for a refusal), then starts campaigning."""
        if self._campaigner is not None:
            return self
        await self._first_look()
        self._wake = asyncio.Event()
        self._campaigner = asyncio.ensure_future(self._campaign())
        self._watcher = asyncio.ensure_future(self._watch())
        return self

    async def close(self) -> None:
        """Stops campaigning (a waiting acquire is cancelled, leaving nothing behind); when
        leading, runs the ``on_revoked`` callbacks, then releases the lease, and returns after
        that. Idempotent."""
        self._closed = True
        if self._watcher is not None:
            self._watcher.cancel()
        campaigner = self._campaigner
        if campaigner is None or campaigner is asyncio.current_task():
            return
        if self._waiting:
            campaigner.cancel()
        assert self._wake is not None
        self._wake.set()
        await asyncio.wait({campaigner})

    async def resign(self) -> None:
        await self.close()

    async def __aenter__(self) -> "AsyncLeadership":
        return await self.start()

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    def __repr__(self) -> str:
        return f"<AsyncLeadership key={self.key!r} name={self.name!r} leader={self.is_leader()}>"

    # -- the tasks ------------------------------------------------------------------------------

    async def _first_look(self) -> None:
        path, context = inspect_request(self._client.url, self.key, False)
        core = self._client._core
        try:
            answer = await core.transport.request("GET", path, timeout=core.timeout)
        except NoAnswer:
            return
        check_look(self.key, answer, context)

    async def _campaign(self) -> None:
        assert self._wake is not None
        backoff = Backoff()
        while not self._closed:
            self._waiting = True
            try:
                lease = await self._client.acquire(self.key, self.ttl, self._part, owner=self.name)
            except Locked:
                backoff.reset()
                continue
            except Unavailable as e:
                log.debug("campaign for %r: %s", self.key, e)
                await self._pause(backoff.delay())
                continue
            except BrokerError as e:
                if not self._client._core.closed:
                    log.error("campaign for %r stopped: %s", self.key, e)
                    self._error = e
                return
            finally:
                self._waiting = False
            if self._closed:
                await _release(lease)
                return
            self._lease = lease
            self._wake.clear()
            lease.on_lost(self._wake.set)
            log.info("%s leads %r (fence %d)", self.name, self.key, lease.fence)
            for callback in list(self._elected):
                await _call(callback, lease, "on_elected")
            while not self._closed and lease.held:
                try:
                    # on_lost and close() wake this at once; the timeout is for a lease ended
                    # without a loss (released by the AsyncBroker's close()).
                    await asyncio.wait_for(self._wake.wait(), 1.0)
                except asyncio.TimeoutError:
                    pass
            closing = self._closed
            for callback in list(self._revoked):
                await _call(callback, lease, "on_revoked")
            self._lease = None
            if closing:
                await _release(lease)
                return
            log.info("%s no longer leads %r: %s", self.name, self.key, lease.lost_reason)

    async def _pause(self, delay: float) -> None:
        assert self._wake is not None
        try:
            await asyncio.wait_for(self._wake.wait(), delay)
        except asyncio.TimeoutError:
            pass

    async def _watch(self) -> None:
        backoff = Backoff()
        while not self._closed:
            try:
                async for view in self._client.follow(self.key, part=self._part):
                    self._view = view
                    backoff.reset()
            except BrokerError as e:
                if self._closed or self._client._core.closed:
                    return
                log.debug("watch of %r for its leader: %s", self.key, e)
                await asyncio.sleep(backoff.delay())


async def _release(lease: "AsyncLease") -> None:
    try:
        await lease.release()
    except BrokerError as e:
        log.warning("could not release the leadership lease on %r (fence %d): %s",
                    lease.key, lease.fence, e)


async def _call(callback: Callable[..., Any], lease: "AsyncLease", what: str) -> None:
    try:
        result = callback(lease) if _takes_an_argument(callback) else callback()
        if inspect.isawaitable(result):
            await result
    except Exception:
        log.exception("a %s callback of the leadership of %r raised", what, lease.key)
