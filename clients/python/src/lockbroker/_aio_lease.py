"""The asyncio client's lease (:class:`AsyncLease`, re-exported by ``lockbroker.aio``): its
renewal as a task on the loop that acquired it, its lost callbacks run on that loop, and its
release; and what an ``AsyncBroker``'s leases share with it (:class:`_AsyncCore`).
"""

import asyncio
import inspect
import logging
import time
from typing import Any, Callable, Dict, Optional, Set, Tuple

from ._aio_transport import AsyncTransport
from ._errors import BrokerError
from ._lease_state import (_GONE, _RENEWED, _STOPPED, _WAIT, EXPIRED, LeaseState,
                           _takes_an_argument, earlier, ttl_ms)
from ._several import SeveralKeys
from ._transport import Answer

log = logging.getLogger("lockbroker")


class _AsyncCore:
    """What an AsyncBroker's leases share with it."""

    def __init__(self, transport: AsyncTransport, timeout: float, renew_fraction: float):
        self.transport = transport
        self.url = transport.url
        self.timeout = timeout
        self.renew_fraction = renew_fraction
        self.leases: Set["AsyncLease"] = set()
        self.sessions: Set[Any] = set()
        self.closed = False
        #: Clean-ups of cancelled acquires under way (``close`` waits for them).
        self.cleanups: Set["asyncio.Future[None]"] = set()
        #: Tasks of coroutine callbacks (kept referenced while they run).
        self.callbacks: Set["asyncio.Future[Any]"] = set()

    def forget(self, lease: "AsyncLease") -> None:
        self.leases.discard(lease)

    def forget_session(self, session: Any) -> None:
        self.sessions.discard(session)

    def call(self, callback: Callable[..., Any], args: tuple, what: str) -> None:
        """Runs a plain callback now, or a coroutine one as a task on the loop."""
        try:
            result = callback(*args)
        except Exception:
            log.exception("%s raised", what)
            return
        if inspect.isawaitable(result):
            task = asyncio.ensure_future(result)
            self.callbacks.add(task)
            task.add_done_callback(lambda t: self._finished(t, what))

    def _finished(self, task: "asyncio.Future[Any]", what: str) -> None:
        self.callbacks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("%s raised", what, exc_info=task.exception())


class AsyncLease(LeaseState):
    """A lease of the asyncio client: what :class:`~lockbroker.Lease` is, with coroutines for
    ``renew``, ``release`` and ``close``, and ``async with`` (releases on exit). It is renewed
    by a task on the loop that acquired it; lost callbacks (no argument, or the lease; plain
    functions or coroutine functions) run on that loop."""

    def __init__(self, core: _AsyncCore, **kwargs: Any):
        super().__init__(core, **kwargs)
        self._task: Optional["asyncio.Task[None]"] = None
        self._sleeping = False

    def on_lost(self, callback: Callable[..., Any]) -> None:
        """Registers ``callback`` to run once when the lease is lost (a coroutine function's
        coroutine runs as a task). Registered after the loss, it runs at once. A released
        lease is not lost: its callbacks never run."""
        if not self._add_callback(callback):
            self._run_callback(callback)

    async def renew(self, ttl: Optional[float] = None) -> bool:
        """As :meth:`lockbroker.Lease.renew`."""
        if self._renew_args(ttl) is False:
            return False
        outcome, answer, problem = await self._renew_once(time.monotonic())
        if outcome == _RENEWED and self._task is not None and self._sleeping:
            # The renewal task sleeps until a time this renewal moved: it starts over.
            self._task.cancel()
            self._start()
        return self._renew_result(outcome, answer, problem)

    async def release(self) -> None:
        """As :meth:`lockbroker.Lease.release`: the renewal task stops first (a renewal under
        way is abandoned), then the ``DELETE``, retried for up to the broker's ``timeout``."""
        await self._release(time.monotonic() + self._core.timeout)

    async def close(self) -> None:
        """The same as :meth:`release`."""
        await self.release()

    async def __aenter__(self) -> "AsyncLease":
        return self

    async def __aexit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        try:
            await self.release()
        except BrokerError as e:
            self._release_failed_on_exit(exc_type, e)

    async def _release(self, give_up: float) -> None:
        with self._lock:
            if self._release_done:
                return
            self._released = True
        task = self._task
        if task is not None and task is not asyncio.current_task() and not task.done():
            task.cancel()
            await asyncio.wait({task})
        while True:
            answer, problem = await self._core.transport.attempt(
                "DELETE", self._release_path(), headers={"Lock-Token": self._token},
                timeout=max(give_up - time.monotonic(), 0.05))
            done, pause = self._deleted(self._release_answer(answer), problem, give_up)
            if done:
                break
            await asyncio.sleep(pause)
        self._release_finished()

    # -- the renewal task ---------------------------------------------------------------------

    def _start(self) -> None:
        self._task = asyncio.ensure_future(keep(self))

    async def _renew_once(self, now: float, confirming: bool = False):
        with self._lock:
            begun = self._begin_renewal(now, confirming)
        if begun is None:
            return _STOPPED, None, "released"
        ttl, timeout = begun
        answer, problem = await self._send_renewal({"ttl_ms": ttl_ms(ttl)}, timeout)
        outcome, reason, problem = self._settle(now, ttl, answer, problem, confirming)
        if reason is not None:
            self._lose(reason, problem)
        return outcome, answer, problem

    async def _send_renewal(self, body: Optional[Dict[str, Any]], timeout: float
                            ) -> Tuple[Optional[Answer], str]:
        """As :meth:`lockbroker.Lease._send_renewal`: every key renewed within ``timeout``."""
        give_up = time.monotonic() + timeout
        kept: Optional[Answer] = None
        for path in self._renew_paths():
            answer, problem = await self._core.transport.attempt(
                "POST", path, body=body, headers={"Lock-Token": self._token},
                timeout=max(give_up - time.monotonic(), 0.05))
            if answer is None or answer.status != 200:
                return answer, problem
            kept = earlier(kept, answer)
        return kept, ""

    async def _confirm(self) -> str:
        """The renewal that fixes the end of a lease granted after a wait (see
        ``AsyncBroker._grant``): its outcome."""
        return (await self._renew_once(time.monotonic(), confirming=True))[0]

    async def _drop(self) -> None:
        """Ends a lease that is not handed out, quietly."""
        try:
            await self.release()
        except BrokerError as e:
            log.warning("could not release the lease on %r (fence %d): %s",
                        self.key, self.fence, e)

    def _lose(self, reason: str, problem: Optional[str]) -> None:
        for callback in self._mark_lost(reason, problem) or ():
            self._run_callback(callback)

    def _run_callback(self, callback: Callable[..., Any]) -> None:
        args = (self,) if _takes_an_argument(callback) else ()
        self._core.call(callback, args, f"an on_lost callback of the lease on {self.key!r}")

    def _report_trouble(self, trouble: Optional[str]) -> None:
        if self._on_trouble is not None:
            self._core.call(self._on_trouble, (trouble,),
                            f"the on_trouble hook of the lease on {self.key!r}")


class AsyncSeveralLease(SeveralKeys, AsyncLease):
    """The lease of ``AsyncBroker.acquire_all``: an :class:`AsyncLease` on several keys (as
    :class:`lockbroker.SeveralLease`)."""


async def keep(kept: Any) -> None:
    """The renewal task of a lease or a session (``kept``): renews it when due (its
    ``_renew_once``), loses it when its end came, until it is released, closed or lost."""
    while True:
        now = time.monotonic()
        action, when = kept._next_step(now)
        if action == _STOPPED:
            return
        if action == EXPIRED:
            kept._lose(EXPIRED, None)
            return
        if action == _WAIT:
            kept._sleeping = True
            try:
                await asyncio.sleep(when - now)
            finally:
                kept._sleeping = False
            continue
        outcome, answer, problem = await kept._renew_once(now)
        if outcome == _RENEWED:
            if kept._recovered():
                kept._report_trouble(None)
            continue
        if outcome in (_GONE, _STOPPED):
            return
        trouble = kept._failed(answer, problem)
        if trouble is not None:
            kept._report_trouble(trouble)
