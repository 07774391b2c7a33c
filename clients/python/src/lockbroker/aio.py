"""The asyncio client of lockbroker: the names of :class:`~lockbroker.Broker`, as coroutines.

    from lockbroker.aio import AsyncBroker

    async with AsyncBroker("http://127.0.0.1:8080") as broker:
        async with await broker.acquire("orders:42", ttl=10, wait=5) as lease:
            ...  # write, passing lease.fence to the resource; stop if lease.held turns false

Standard library only, and no thread: requests are HTTP/1.1 on ``asyncio`` streams (a pool of
kept-alive connections, one per request in flight), and each lease is renewed by a task on the
loop that acquired it. Use an ``AsyncBroker`` and its leases from that one loop.

Cancellation leaves nothing behind: an acquire cancelled while it waits closes its request (the
broker stops waiting for it), then asks again with the same ``request_id`` to learn whether it
was granted meanwhile, and releases what it was granted, before the cancellation goes on.
"""

import asyncio
import logging
import ssl
import time
from typing import Any, AsyncIterator, Awaitable, Callable, Dict, Iterable, Optional, TypeVar

from ._broker import USER_AGENT, ClientBase
from ._calls import (
    AGAIN,
    GRANTED,
    PAUSE,
    CallRun,
    GrantRun,
    Page,
    force_request,
    forced,
    inspect_request,
    inspect_view,
    list_page,
    list_request,
)
from ._errors import BrokerError, LeaseLost, LimitMismatch, Locked, Unavailable, where
from ._lease_state import _GONE, _RENEWED, Backoff
from ._aio_leadership import AsyncLeadership
from ._aio_lease import AsyncLease, AsyncSeveralLease, _AsyncCore
from ._aio_session import AsyncSession, AsyncSessionLease
from ._aio_transport import AsyncTransport
from ._session_state import OpenRun
from ._several import acquire_all_run
from ._transport import RETRYABLE, NoAnswer
from ._watch import KeyView, WatchRun, check_fence, check_wait

__all__ = [
    "AsyncBroker",
    "AsyncLeadership",
    "AsyncLease",
    "AsyncSession",
    "AsyncSessionLease",
    "BrokerError",
    "KeyView",
    "LeaseLost",
    "LimitMismatch",
    "Locked",
    "Page",
    "Unavailable",
]

log = logging.getLogger("lockbroker")

T = TypeVar("T")
G = TypeVar("G")

#: How long a cancelled acquire waits for its clean-up before the cancellation goes on.
_CLEAN_UP_WAIT = 2.0


class AsyncBroker(ClientBase):
    """An asyncio client of the broker at ``url``, with the settings of
    :class:`~lockbroker.Broker`. An async context manager: leaving it (or ``await close()``)
    releases every lease still open. Use it from one event loop. ``AsyncBroker.from_env()``
    reads ``$LOCKBROKER_URL`` and ``$LOCKBROKER_AUTH_TOKEN`` as :meth:`Broker.from_env` does."""

    def _make_core(self, url: str, token: Optional[str], ssl_context: Optional[ssl.SSLContext],
                   timeout: float, renew_fraction: float) -> _AsyncCore:
        transport = AsyncTransport(url, token, ssl_context, USER_AGENT)
        return _AsyncCore(transport, timeout, renew_fraction)

    # -- locks and permits ----------------------------------------------------------------------

    async def acquire(self, key: str, ttl: float = 30.0, wait: float = 0.0, *,
                      shared: bool = False, owner: Optional[str] = None,
                      auto_renew: bool = True, renew_every: Optional[float] = None,
                      on_trouble: Optional[Callable[[Optional[str]], Any]] = None) -> AsyncLease:
        """As :meth:`lockbroker.Broker.acquire`. Cancelled while it waits, it leaves nothing
        behind (see the module's documentation)."""
        params: Dict[str, Any] = {"mode": "shared"} if shared else {}
        return await self._acquire("locks", key, ttl, wait, params,
                                   "shared" if shared else "exclusive", owner, auto_renew,
                                   renew_every, on_trouble)

    async def try_acquire(self, key: str, ttl: float = 30.0, **options: Any) -> Optional[AsyncLease]:
        """As :meth:`acquire` without waiting: ``None`` when someone else holds the key."""
        try:
            return await self.acquire(key, ttl, 0.0, **options)
        except Locked:
            return None

    async def acquire_permit(self, key: str, limit: int, ttl: float = 30.0, wait: float = 0.0,
                             *, owner: Optional[str] = None, auto_renew: bool = True,
                             renew_every: Optional[float] = None,
                             on_trouble: Optional[Callable[[Optional[str]], Any]] = None
                             ) -> AsyncLease:
        """As :meth:`lockbroker.Broker.acquire_permit`."""
        if isinstance(limit, bool) or not isinstance(limit, int):
            raise TypeError("limit is an int")
        return await self._acquire("semaphores", key, ttl, wait, {"limit": limit}, "permit",
                                   owner, auto_renew, renew_every, on_trouble)

    async def try_acquire_permit(self, key: str, limit: int, ttl: float = 30.0,
                                 **options: Any) -> Optional[AsyncLease]:
        """As :meth:`acquire_permit` without waiting: ``None`` when all permits are taken."""
        try:
            return await self.acquire_permit(key, limit, ttl, 0.0, **options)
        except Locked:
            return None

    async def acquire_all(self, keys: Iterable[str], ttl: float = 30.0, wait: float = 0.0, *,
                          shared: bool = False, owner: Optional[str] = None,
                          auto_renew: bool = True, renew_every: Optional[float] = None,
                          on_trouble: Optional[Callable[[Optional[str]], Any]] = None
                          ) -> AsyncLease:
        """As :meth:`lockbroker.Broker.acquire_all`. Cancelled while it waits, it leaves
        nothing behind."""
        run = acquire_all_run(self, keys, ttl, wait, shared, owner, auto_renew, renew_every,
                              on_trouble)
        return await self._grant(run, lambda args: AsyncSeveralLease(self._core, **args),
                                 self._register_lease)

    async def with_lease(self, key: str, ttl: float, wait: float,
                         work: Callable[[AsyncLease], Awaitable[T]], **options: Any) -> T:
        """Runs ``await work(lease)`` as a task under a lease on ``key`` (taken as
        :meth:`acquire` takes it) and releases the lease on the way out; returns what the work
        returns. If the lease is lost first, the work is cancelled and :class:`LeaseLost`
        raised. Cancelling ``with_lease`` cancels the work too."""
        lease = await self.acquire(key, ttl, wait, **options)
        async with lease:
            task = asyncio.ensure_future(work(lease))
            lease.on_lost(lambda: task.cancel())
            try:
                await asyncio.wait({task})
            except asyncio.CancelledError:
                task.cancel()
                await asyncio.wait({task})
                raise
            if task.cancelled() and lease.lost_reason is not None:
                raise LeaseLost(f"{where('work under', key, self.url)} was cancelled: the lease "
                                f"(fence {lease.fence}) was lost ({lease.lost_reason})",
                                reason=lease.lost_reason)
            return task.result()

    # -- sessions -------------------------------------------------------------------------------

    async def open_session(self, ttl: float = 15.0, lock_delay: float = 0.0, *,
                           owner: Optional[str] = None) -> AsyncSession:
        """As :meth:`lockbroker.Broker.open_session`; the keep-alive is a task on this loop.
        Cancelled while it waits, it leaves nothing behind (a session opened meanwhile is
        closed)."""
        run = OpenRun(self.url, ttl, lock_delay, owner if owner is not None else self._owner,
                      self._max_wait, self._core.timeout)
        return await self._grant(run, lambda args: AsyncSession(self, self._core, **args),
                                 self._register_session)

    # -- watching -------------------------------------------------------------------------------

    async def watch(self, key: str, seen_fence: int = 0, wait: float = 30.0) -> KeyView:
        """As :meth:`lockbroker.Broker.watch`."""
        return await self._watch("locks", key, seen_fence, wait)

    async def watch_permits(self, key: str, seen_fence: int = 0, wait: float = 30.0) -> KeyView:
        """As :meth:`lockbroker.Broker.watch_permits`."""
        return await self._watch("semaphores", key, seen_fence, wait)

    async def follow(self, key: str, seen_fence: int = 0, *, part: float = 10.0,
                     semaphore: bool = False) -> AsyncIterator[KeyView]:
        """Every change of the lock (or semaphore) ``key`` from ``seen_fence`` on, once and in
        order: ``async for view in broker.follow(key):`` (leave the loop, or cancel its task,
        to stop). Raises :class:`Unavailable` when the broker could not be reached for a whole
        ``part``."""
        fence = check_fence(seen_fence)
        if not check_wait(part) > 0:
            raise ValueError("part must be a positive number of seconds")
        space = "semaphores" if semaphore else "locks"
        while True:
            view = await self._watch(space, key, fence, part)
            if view.changed:
                fence = view.next_fence
                yield view

    async def _watch(self, space: str, key: str, seen_fence: int, wait: float) -> KeyView:
        run = WatchRun(self.url, self._max_wait, self._core.timeout, space, key, seen_fence, wait)
        while True:
            self._check_open()
            target, timeout = run.request()
            answer, problem = await self._core.transport.attempt("GET", target, timeout=timeout)
            view, pause = run.answered(answer, problem)
            if view is not None:
                return view
            if pause:
                await asyncio.sleep(pause)

    # -- looking and force release --------------------------------------------------------------

    async def inspect(self, key: str, *, semaphore: bool = False) -> KeyView:
        """As :meth:`lockbroker.Broker.inspect`."""
        path, context = inspect_request(self.url, key, semaphore)
        return await self._call("GET", path, CallRun(context, self._core.timeout),
                                lambda answer: inspect_view(key, answer, semaphore))

    async def list(self, prefix: str = "", *, limit: int = 100,
                   cursor: Optional[str] = None) -> Page:
        """As :meth:`lockbroker.Broker.list`."""
        path, context = list_request(self.url, prefix, limit, cursor)
        return await self._call("GET", path, CallRun(context, self._core.timeout), list_page)

    async def force_release(self, key: str, *, semaphore: bool = False) -> bool:
        """As :meth:`lockbroker.Broker.force_release`."""
        path, context = force_request(self.url, key, semaphore)
        return await self._call("DELETE", path,
                                CallRun(context, self._core.timeout, repeatable=False), forced)

    # -- the client's life ----------------------------------------------------------------------

    async def close(self) -> None:
        """Closes every session and releases every lease still open (their renewal tasks stop
        first), waits for the clean-ups of cancelled acquires, and closes the connections.
        Idempotent."""
        self._core.closed = True
        sessions, leases = list(self._core.sessions), list(self._core.leases)
        give_up = time.monotonic() + self._core.timeout
        await asyncio.gather(*(session._close(give_up) for session in sessions))
        results = await asyncio.gather(*(lease._release(give_up) for lease in leases),
                                       return_exceptions=True)
        for lease, result in zip(leases, results):
            if isinstance(result, BrokerError):
                log.warning("could not release the lease on %r (fence %d): %s",
                            lease.key, lease.fence, result)
        if self._core.cleanups:
            await asyncio.wait(set(self._core.cleanups), timeout=self._core.timeout)
        await self._core.transport.close()

    async def __aenter__(self) -> "AsyncBroker":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    # -- inside ---------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._core.closed:
            raise BrokerError("this AsyncBroker is closed", code="closed")

    async def _call(self, method: str, path: str, run: CallRun,
                    outcome: Callable[[Any], Any]) -> Any:
        while True:
            self._check_open()
            try:
                answer = await self._core.transport.request(method, path,
                                                            timeout=run.request_timeout())
            except NoAnswer as e:
                pause = run.no_answer(e)
            else:
                result = outcome(answer)
                if result is not None:
                    return result
                pause = run.retry(answer)
            await asyncio.sleep(pause)

    async def _acquire(self, space: str, key: str, ttl: float, wait: float,
                       params: Dict[str, Any], mode: str, owner: Optional[str],
                       auto_renew: bool, renew_every: Optional[float],
                       on_trouble: Optional[Callable[[Optional[str]], Any]]) -> AsyncLease:
        run = self._acquire_run(space, key, ttl, wait, params, mode, owner, auto_renew,
                                renew_every, on_trouble)
        return await self._grant(run, lambda args: AsyncLease(self._core, **args),
                                 self._register_lease)

    async def _grant(self, run: GrantRun, make: Callable[[Dict[str, Any]], G],
                     register: Callable[[G], Optional[BrokerError]]) -> G:
        """As ``Broker._grant``; cancelled, it leaves nothing behind (see ``_abandon``)."""
        made: Any = None
        try:
            while True:
                self._check_open()
                body, timeout = run.request()
                try:
                    answer = await self._core.transport.request(
                        "POST", run.path, body=body, timeout=timeout, ordered=run.ordered,
                        sending=run.sending)
                except NoAnswer as e:
                    action, delay = PAUSE, run.no_answer(e)
                else:
                    action, delay = run.answered(answer)
                if action == GRANTED:
                    made = make(run.args(answer.body))
                    if run.needs_confirming():
                        outcome = await made._confirm()
                        if outcome == _GONE:
                            made = None
                            run.grant_gone()
                            continue
                        if outcome != _RENEWED and not made._still_live():
                            await made._drop()
                            made = None
                            raise run.unconfirmed()
                    # From here to the return nothing awaits: a cancellation cannot come between.
                    refusal = register(made)
                    if refusal is not None:
                        await made._drop()
                        made = None
                        raise refusal
                    return made
                if action == AGAIN:
                    continue
                await asyncio.sleep(run.pause(delay))
        except asyncio.CancelledError:
            if made is not None or run.may_have_reached:
                await self._abandon(run, made, make)
            raise

    def _register_lease(self, lease: AsyncLease) -> Optional[BrokerError]:
        if self._core.closed:
            return BrokerError("this AsyncBroker is closed", code="closed")
        self._core.leases.add(lease)
        lease._start()
        return None

    def _register_session(self, session: AsyncSession) -> Optional[BrokerError]:
        if self._core.closed:
            return BrokerError("this AsyncBroker is closed", code="closed")
        self._core.sessions.add(session)
        session._start()
        return None

    async def _abandon(self, run: GrantRun, made: Any, make: Callable[[Dict[str, Any]], Any]
                       ) -> None:
        """After the cancellation of an acquire (or of opening a session): ends what it may
        have been granted, before the cancellation goes on. A broker that does not answer
        within :data:`_CLEAN_UP_WAIT` (or a second cancellation) leaves the clean-up to go on
        in the background (``close`` waits for it)."""
        task = asyncio.ensure_future(self._clean_up(run, made, make))
        self._core.cleanups.add(task)
        task.add_done_callback(self._core.cleanups.discard)
        try:
            await asyncio.wait({task}, timeout=min(_CLEAN_UP_WAIT, self._core.timeout))
        except asyncio.CancelledError:
            pass  # cancelled again: the clean-up goes on by itself

    async def _clean_up(self, run: GrantRun, made: Any,
                        make: Callable[[Dict[str, Any]], Any]) -> None:
        if made is None:
            made = await self._find_grant(run, make)
            if made is None:
                return
            log.info("%s was cancelled after its grant: ending %r", run.context, made)
        await made._drop()

    async def _find_grant(self, run: GrantRun, make: Callable[[Dict[str, Any]], Any]) -> Any:
        """Asks again with the cancelled call's ``request_id`` without waiting: what it was
        granted (or, the key being free, is granted now), to end; ``None`` when it holds
        nothing."""
        body = run.again_body()
        give_up = time.monotonic() + self._core.timeout
        backoff = Backoff()
        while True:
            answer, problem = await self._core.transport.attempt(
                "POST", run.path, body=body, timeout=max(give_up - time.monotonic(), 0.05),
                ordered=run.ordered)
            if answer is not None:
                if answer.status == 201:
                    try:
                        return make(run.args(answer.body, sent_at=time.monotonic()))
                    except BrokerError:
                        return None
                if answer.status not in RETRYABLE:
                    return None  # 409 locked: this request holds nothing
                problem = answer.message
            now = time.monotonic()
            if now >= give_up:
                log.warning("%s was cancelled, and whether it was granted could not be learnt "
                            "(%s): what it may have been granted ends by its ttl",
                            run.context, problem)
                return None
            await asyncio.sleep(min(backoff.delay(answer.retry_after() if answer else None),
                                    give_up - now))
