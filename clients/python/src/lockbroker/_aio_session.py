"""The asyncio client's session (:class:`AsyncSession`, re-exported by ``lockbroker.aio``): its
one keep-alive as a task on the loop that opened it, its lost callbacks run on that loop, its
close; and the leases taken under it (:class:`AsyncSessionLease`)."""

import asyncio
import time
from typing import Any, Callable, Dict, Iterable, Optional, Tuple

from ._aio_lease import AsyncLease, keep
from ._errors import BrokerError, Locked
from ._lease_state import _STOPPED, NOT_HELD, _takes_an_argument
from ._session_state import SessionBound, SessionState
from ._several import SeveralKeys, session_run
from ._transport import Answer


class AsyncSessionLease(SessionBound, AsyncLease):
    """A lease taken under an :class:`AsyncSession`: an ``AsyncLease`` held while its session
    lives, lost with it, never renewed on its own; ``await release()`` ends this lease only."""

    def __init__(self, core: Any, session: "AsyncSession", **kwargs: Any):
        self._session = session
        super().__init__(core, **kwargs)

    async def renew(self, ttl: Optional[float] = None) -> bool:
        """As :meth:`lockbroker.SessionLease.renew`: whether the lease still stands (a force
        release is seen here, not by the session's keep-alive); ``ttl`` is not used."""
        if self._renew_check() is False:
            return False
        answer, problem = await self._send_renewal(None, self._core.timeout)
        outcome, reason, problem = self._renew_answer(answer, problem)
        if reason is not None:
            self._lose(reason, problem)
        return self._renew_result(outcome, answer, problem)


class AsyncSessionSeveralLease(SeveralKeys, AsyncSessionLease):
    """The lease of :meth:`AsyncSession.acquire_all`: an ``AsyncSessionLease`` on several
    keys."""


class AsyncSession(SessionState):
    """A session of an ``AsyncBroker`` (``await broker.open_session(ttl, lock_delay)``): what
    :class:`lockbroker.Session` is, with coroutines for the acquires and ``close``, and
    ``async with`` (closes on exit). Its keep-alive is a task on the loop that opened it; lost
    callbacks (no argument, or the session; plain or coroutine functions) run on that loop."""

    def __init__(self, client: Any, core: Any, **kwargs: Any):
        super().__init__(client, core, **kwargs)
        self._task: Optional["asyncio.Task[None]"] = None
        self._sleeping = False

    # -- leases under it ------------------------------------------------------------------------

    async def acquire(self, key: str, wait: float = 0.0, *, shared: bool = False,
                      owner: Optional[str] = None) -> AsyncLease:
        """As :meth:`lockbroker.Session.acquire`. Cancelled while it waits, it leaves nothing
        behind (a grant that came meanwhile is released)."""
        params: Dict[str, Any] = {"mode": "shared"} if shared else {}
        return await self._acquire("locks", key, wait, params,
                                   "shared" if shared else "exclusive", owner)

    async def try_acquire(self, key: str, *, shared: bool = False,
                          owner: Optional[str] = None) -> Optional[AsyncLease]:
        """As :meth:`acquire` without waiting: ``None`` when someone else holds the key."""
        try:
            return await self.acquire(key, 0.0, shared=shared, owner=owner)
        except Locked:
            return None

    async def acquire_permit(self, key: str, limit: int, wait: float = 0.0, *,
                             owner: Optional[str] = None) -> AsyncLease:
        """As :meth:`lockbroker.Session.acquire_permit`."""
        if isinstance(limit, bool) or not isinstance(limit, int):
            raise TypeError("limit is an int")
        return await self._acquire("semaphores", key, wait, {"limit": limit}, "permit", owner)

    async def try_acquire_permit(self, key: str, limit: int, *,
                                 owner: Optional[str] = None) -> Optional[AsyncLease]:
        """As :meth:`acquire_permit` without waiting: ``None`` when all permits are taken."""
        try:
            return await self.acquire_permit(key, limit, 0.0, owner=owner)
        except Locked:
            return None

    async def acquire_all(self, keys: Iterable[str], wait: float = 0.0, *,
                          shared: bool = False, owner: Optional[str] = None) -> AsyncLease:
        """As :meth:`lockbroker.Session.acquire_all`. Cancelled while it waits, it leaves
        nothing behind."""
        return await self._take(session_run(self, keys, wait, shared, owner),
                                lambda args: AsyncSessionSeveralLease(self._core, self, **args))

    async def _acquire(self, space: str, key: str, wait: float, params: Dict[str, Any],
                       mode: str, owner: Optional[str]) -> AsyncLease:
        return await self._take(self._acquire_run(space, key, wait, params, mode, owner),
                                lambda args: AsyncSessionLease(self._core, self, **args))

    async def _take(self, run: Any, make: Callable[[Dict[str, Any]], AsyncLease]) -> AsyncLease:
        try:
            return await self._client._grant(run, make, self._adopt)
        except BrokerError as e:
            if e.code == "no_session" and e.status == 404:
                self._lose(NOT_HELD, str(e))
            raise

    # -- the application's side -----------------------------------------------------------------

    def on_lost(self, callback: Callable[..., Any]) -> None:
        """Registers ``callback`` to run once when the session is lost, before its leases' lost
        callbacks (a coroutine function's coroutine runs as a task). Registered after the loss,
        it runs at once. Closing is not losing: it never runs then."""
        if not self._add_callback(callback):
            self._run_callback(callback)

    async def close(self) -> None:
        """As :meth:`lockbroker.Session.close`: the keep-alive task stops first, then the
        ``DELETE`` (which releases every lease under the session), retried for up to the
        broker's ``timeout``. Never raises; idempotent."""
        await self._close(time.monotonic() + self._core.timeout)

    async def _close(self, give_up: float) -> None:
        marked = self._mark_closed()
        if marked is None:
            return
        standing, leases = marked
        for lease in leases:
            lease._released_with_session()
        self._core.forget_session(self)
        task = self._task
        if task is not None and task is not asyncio.current_task() and not task.done():
            task.cancel()
            await asyncio.wait({task})
        while standing:
            answer, problem = await self._core.transport.attempt(
                "DELETE", self._path, timeout=max(give_up - time.monotonic(), 0.05))
            pause = self._closed_answer(answer, problem, give_up)
            if pause is None:
                break
            await asyncio.sleep(pause)

    async def __aenter__(self) -> "AsyncSession":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    # -- the keep-alive task --------------------------------------------------------------------

    def _start(self) -> None:
        self._task = asyncio.ensure_future(keep(self))

    async def _renew_once(self, now: float, confirming: bool = False
                          ) -> Tuple[str, Optional[Answer], str]:
        timeout = self._begin_keep_alive(now, confirming)
        if timeout is None:
            return _STOPPED, None, "closed"
        answer, problem = await self._core.transport.attempt(
            "POST", self._path + "/renew", body={"ttl_ms": round(self.ttl * 1000)},
            timeout=timeout)
        outcome, reason, problem = self._settle(now, answer, problem, confirming)
        if reason is not None:
            self._lose(reason, problem)
        return outcome, answer, problem

    def _run_callback(self, callback: Callable[..., Any]) -> None:
        args = (self,) if _takes_an_argument(callback) else ()
        self._core.call(callback, args, f"an on_lost callback of a session at {self._core.url}")

    # -- as a grant (see AsyncBroker._grant) ----------------------------------------------------

    async def _confirm(self) -> str:
        return (await self._renew_once(time.monotonic(), confirming=True))[0]

    async def _drop(self) -> None:
        await self.close()
