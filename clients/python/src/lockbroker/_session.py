"""A sync session (:class:`Session`): one keep-alive for every lease taken under it, run by its
:class:`~lockbroker.Broker`'s one renewal thread (with the plain leases' renewals: no thread per
session), its lost signal, and its close; and the leases taken under it
(:class:`SessionLease`)."""

import logging
import time
from typing import Any, Callable, Dict, Iterable, Optional, Tuple

from ._errors import BrokerError, Locked
from ._lease import Lease, call_back, step
from ._lease_state import _STOPPED, NOT_HELD
from ._session_state import SessionBound, SessionState
from ._several import SeveralKeys, session_run
from ._transport import Answer

log = logging.getLogger("lockbroker")


class SessionLease(SessionBound, Lease):
    """A lease taken under a :class:`Session`: a :class:`~lockbroker.Lease` that is held while
    its session lives, and is lost with it. It is not renewed on its own; ``release()`` ends
    this lease only (the session goes on)."""

    def __init__(self, core: Any, session: "Session", **kwargs: Any):
        self._session = session
        super().__init__(core, **kwargs)

    def renew(self, ttl: Optional[float] = None) -> bool:
        """Asks the broker whether the lease still stands (a lease under a session has the
        session's end; ``ttl`` is not used): ``True`` if it does, ``False`` when it is lost
        (say, force released: the session's keep-alive does not see that)."""
        if self._renew_check() is False:
            return False
        with self._cond:
            if self._released:
                raise BrokerError("the lease was released", code="released")
            self._in_flight += 1
        try:
            answer, problem = self._send_renewal(None, self._core.timeout)
        finally:
            with self._cond:
                self._in_flight -= 1
                self._cond.notify_all()
        outcome, reason, problem = self._renew_answer(answer, problem)
        if reason is not None:
            self._lose(reason, problem)
        return self._renew_result(outcome, answer, problem)


class SessionSeveralLease(SeveralKeys, SessionLease):
    """The lease of :meth:`Session.acquire_all`: a :class:`SessionLease` on several keys."""


class Session(SessionState):
    """A session of a :class:`~lockbroker.Broker` (``broker.open_session(ttl, lock_delay)``):
    one keep-alive keeps every lease taken under it, and when it is lost, all of them are.

    Attributes: ``ttl``, ``lock_delay`` (seconds), ``owner``, ``expires_at`` (Unix seconds on the
    broker's store clock, as last kept alive). ``alive``, ``lost_reason``, ``leases``. A context
    manager: leaving the block closes it. Its secret is never shown.
    """

    def __init__(self, client: Any, core: Any, **kwargs: Any):
        super().__init__(client, core, **kwargs)
        #: When the renewal thread will look at this session next (its business, under its lock).
        self._scheduled: Optional[float] = None

    # -- leases under it ------------------------------------------------------------------------

    def acquire(self, key: str, wait: float = 0.0, *, shared: bool = False,
                owner: Optional[str] = None) -> Lease:
        """Takes the lock on ``key`` under this session (no ttl of its own: it lives as long as
        the session), waiting up to ``wait`` seconds; ``shared=True`` for a shared lease. Raises
        as :meth:`Broker.acquire` does, and :class:`BrokerError` (code ``no_session``) when the
        session has ended (it is lost then), ``closed`` when it was closed."""
        params: Dict[str, Any] = {"mode": "shared"} if shared else {}
        return self._acquire("locks", key, wait, params, "shared" if shared else "exclusive",
                             owner)

    def try_acquire(self, key: str, *, shared: bool = False,
                    owner: Optional[str] = None) -> Optional[Lease]:
        """As :meth:`acquire` without waiting: ``None`` when someone else holds the key."""
        try:
            return self.acquire(key, 0.0, shared=shared, owner=owner)
        except Locked:
            return None

    def acquire_permit(self, key: str, limit: int, wait: float = 0.0, *,
                       owner: Optional[str] = None) -> Lease:
        """One of the ``limit`` permits of the semaphore ``key``, under this session."""
        if isinstance(limit, bool) or not isinstance(limit, int):
            raise TypeError("limit is an int")
        return self._acquire("semaphores", key, wait, {"limit": limit}, "permit", owner)

    def try_acquire_permit(self, key: str, limit: int, *,
                           owner: Optional[str] = None) -> Optional[Lease]:
        """As :meth:`acquire_permit` without waiting: ``None`` when all permits are taken."""
        try:
            return self.acquire_permit(key, limit, 0.0, owner=owner)
        except Locked:
            return None

    def acquire_all(self, keys: Iterable[str], wait: float = 0.0, *, shared: bool = False,
                    owner: Optional[str] = None) -> Lease:
        """Every key of ``keys`` under this session, or none: as
        :meth:`Broker.acquire_all`, but the lease is kept by the session's keep-alive (not
        renewed key by key) and lost with it."""
        return self._take(session_run(self, keys, wait, shared, owner),
                          lambda args: SessionSeveralLease(self._core, self, **args))

    def _acquire(self, space: str, key: str, wait: float, params: Dict[str, Any], mode: str,
                 owner: Optional[str]) -> Lease:
        return self._take(self._acquire_run(space, key, wait, params, mode, owner),
                          lambda args: SessionLease(self._core, self, **args))

    def _take(self, run: Any, make: Callable[[Dict[str, Any]], Lease]) -> Lease:
        try:
            return self._client._grant(run, make, self._adopt)
        except BrokerError as e:
            if e.code == "no_session" and e.status == 404:
                self._lose(NOT_HELD, str(e))
            raise

    # -- the application's side -----------------------------------------------------------------

    def on_lost(self, callback: Callable[..., Any]) -> None:
        """Registers ``callback`` (no argument, or the session) to run once when the session is
        lost, on the client's renewal thread, before the lost callbacks of its leases. A
        callback registered after the loss runs at once. Closing is not losing: it never runs
        then."""
        if not self._add_callback(callback):
            self._run_callback(callback)

    def close(self) -> None:
        """Stops the keep-alive, then ``DELETE``s the session, which releases every lease under
        it at once (their ``held`` turns false; their lost callbacks do not run). Retries
        ``503``s and network errors for up to the broker's ``timeout``; never raises: a broker
        that cannot be reached lets the leases end with the session's ttl. Idempotent."""
        self._close(time.monotonic() + self._core.timeout)

    def _close(self, give_up: float) -> None:
        marked = self._mark_closed()
        if marked is None:
            return
        standing, leases = marked
        for lease in leases:
            lease._released_with_session()
        self._core.forget_session(self)
        while standing:
            answer, problem = self._core.transport.attempt(
                "DELETE", self._path, timeout=max(give_up - time.monotonic(), 0.05))
            pause = self._closed_answer(answer, problem, give_up)
            if pause is None:
                break
            time.sleep(pause)

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- the keep-alive, on the Broker's renewal thread -----------------------------------------

    def _start(self) -> None:
        self._core.renewer.schedule(self, self._next_due())

    def _step(self) -> Optional[float]:
        return step(self)

    def _renew_once(self, now: float, confirming: bool = False
                    ) -> Tuple[str, Optional[Answer], str]:
        timeout = self._begin_keep_alive(now, confirming)
        if timeout is None:
            return _STOPPED, None, "closed"
        if not confirming:
            # The renewal thread serves every lease and session of the Broker: this request
            # gives up in time for the others.
            timeout = min(timeout, max(self._core.horizon(self) - now, 0.5))
        answer, problem = self._core.transport.attempt(
            "POST", self._path + "/renew", body={"ttl_ms": round(self.ttl * 1000)},
            timeout=timeout)
        outcome, reason, problem = self._settle(now, answer, problem, confirming)
        if reason is not None:
            self._lose(reason, problem)
        return outcome, answer, problem

    def _run_callback(self, callback: Callable[..., Any]) -> None:
        call_back(callback, self, f"an on_lost callback of a session at {self._core.url}")

    # -- as a grant (see Broker._grant) ---------------------------------------------------------

    def _confirm(self) -> str:
        return self._renew_once(time.monotonic(), confirming=True)[0]

    def _drop(self) -> None:
        self.close()
