"""The client of one broker: acquires locks, shared locks and semaphore permits, and keeps track
of the leases it handed out so that :meth:`Broker.close` ends them. How an acquire retries is in
``_calls``; every lease of one Broker is renewed by its one renewal thread (``_lease.Renewer``).
"""

import logging
import os
import ssl
import time
from typing import Any, Callable, Dict, Iterable, Optional, Type, TypeVar

from ._calls import (
    AGAIN,
    GRANTED,
    AcquireRun,
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
from ._errors import BrokerError, Locked
from ._lease import Lease, SeveralLease, _Core
from ._lease_state import _GONE, _RENEWED
from ._session import Session
from ._session_state import OpenRun
from ._several import acquire_all_run
from ._transport import ClosedOnExit, NoAnswer, Transport
from ._watch import Follower, KeyView, watch_once

__version__ = "0.1.0"
USER_AGENT = f"lockbroker-python/{__version__}"

log = logging.getLogger("lockbroker")

#: The broker's default ``max_wait_ms``: a longer wait is asked for in parts of this length.
DEFAULT_MAX_WAIT = 60.0


#: The environment variables of :meth:`Broker.from_env`. ``LOCKBROKER_TOKEN`` is not one of
#: them: ``lockbroker run`` sets it to the lock's own token, not a bearer token.
URL_VARIABLE = "LOCKBROKER_URL"
TOKEN_VARIABLE = "LOCKBROKER_AUTH_TOKEN"
DEFAULT_URL = "http://127.0.0.1:8080"

T = TypeVar("T")
G = TypeVar("G")
C = TypeVar("C", bound="ClientBase")


def from_environment() -> Dict[str, Any]:
    """``url`` and ``token`` as :meth:`Broker.from_env` reads them."""
    url = os.environ.get(URL_VARIABLE) or DEFAULT_URL
    token = os.environ.get(TOKEN_VARIABLE) or None
    return {"url": url, "token": token}


def check_settings(timeout: float, renew_fraction: float, max_wait: float) -> None:
    if not 0 < renew_fraction < 1:
        raise ValueError("renew_fraction must be between 0 and 1 (exclusive)")
    if not timeout > 0:
        raise ValueError("timeout must be a positive number of seconds")
    if not max_wait >= 0.001:
        raise ValueError("max_wait must be at least 0.001 s")


class ClientBase:
    """The settings both clients take (see :class:`Broker`), ``from_env``, and the start of an
    acquire."""

    def __init__(
        self,
        url: str = DEFAULT_URL,
        token: Optional[str] = None,
        *,
        timeout: float = 10.0,
        renew_fraction: float = 1.0 / 3.0,
        owner: Optional[str] = None,
        max_wait: float = DEFAULT_MAX_WAIT,
        ssl_context: Optional[ssl.SSLContext] = None,
        on_trouble: Optional[Callable[[Optional[str]], Any]] = None,
    ):
        check_settings(timeout, renew_fraction, max_wait)
        self.url = url
        self._owner = owner
        self._max_wait = float(max_wait)
        self._on_trouble = on_trouble
        self._core = self._make_core(url, token, ssl_context, float(timeout),
                                     float(renew_fraction))

    def _make_core(self, url: str, token: Optional[str], ssl_context: Optional[ssl.SSLContext],
                   timeout: float, renew_fraction: float) -> Any:
        raise NotImplementedError

    @classmethod
    def from_env(cls: Type[C], **settings: Any) -> C:
        """A client for ``$LOCKBROKER_URL`` (default ``http://127.0.0.1:8080``) with the bearer
        token ``$LOCKBROKER_AUTH_TOKEN`` (none when unset); ``settings`` as for the
        constructor. (``$LOCKBROKER_TOKEN``, which ``lockbroker run`` sets, is the lock's own
        token, not a bearer token: it is not read.)"""
        return cls(**from_environment(), **settings)  # type: ignore[call-arg]

    def _acquire_run(self, space: str, key: str, ttl: float, wait: float,
                     params: Dict[str, Any], mode: str, owner: Optional[str], auto_renew: bool,
                     renew_every: Optional[float],
                     on_trouble: Optional[Callable[[Optional[str]], Any]]) -> AcquireRun:
        return AcquireRun(self.url, space, key, ttl, wait, params, mode,
                          owner if owner is not None else self._owner, renew_every, auto_renew,
                          on_trouble if on_trouble is not None else self._on_trouble,
                          self._max_wait, self._core.timeout)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} url={self.url!r}>"


class Broker(ClientBase, ClosedOnExit):
    """A client of the broker at ``url``. Thread-safe: share one per process.

    ``token`` is the bearer token of the broker's auth file, if it has one (never shown).
    Keyword-only settings:

    - ``timeout`` (seconds, default 10): how long a request may go unanswered beyond the wait it
      asked the broker for, before the client treats the broker as unreachable.
    - ``renew_fraction`` (default 1/3): leases renew after this fraction of their ttl, unless an
      acquire gives ``renew_every``.
    - ``owner``: the label acquires give by default (shown by ``GET /locks/KEY``).
    - ``max_wait`` (seconds, default 60, the broker's default ``max_wait_ms``): longer waits are
      asked for in parts of at most this length.
    - ``ssl_context``: for ``https://`` brokers with a private CA or client certificates.
    - ``on_trouble``: the default renewal-trouble hook of its leases (see :meth:`acquire`).

    ``close()`` (or leaving a ``with`` block) releases every lease still open and stops their
    renewals. One thread renews every lease of a Broker (started with its first lease).
    """

    def _make_core(self, url: str, token: Optional[str], ssl_context: Optional[ssl.SSLContext],
                   timeout: float, renew_fraction: float) -> "_Core":
        transport = Transport(url, token, ssl_context, USER_AGENT)
        return _Core(transport, timeout, renew_fraction)

    # -- locks ----------------------------------------------------------------------------------

    def acquire(
        self,
        key: str,
        ttl: float = 30.0,
        wait: float = 0.0,
        *,
        shared: bool = False,
        owner: Optional[str] = None,
        auto_renew: bool = True,
        renew_every: Optional[float] = None,
        on_trouble: Optional[Callable[[Optional[str]], Any]] = None,
    ) -> Lease:
        """Takes the lock on ``key`` for ``ttl`` seconds, waiting up to ``wait`` seconds while
        someone else holds it (the broker waits; waiters are served in arrival order).
        ``shared=True`` takes a shared (read) lease instead of an exclusive one.

        The lease renews itself every ``renew_every`` seconds (default: a third of ``ttl``)
        until released, unless ``auto_renew=False``. ``on_trouble`` (default: the Broker's) is
        called on the renewal thread with a description when a renewal fails without ending
        the lease (the first of a streak; renewals go on until the lease's end), and with
        ``None`` when one gets through again.

        Raises ``ValueError`` for a key the broker would refuse, :class:`Locked` when still
        held by someone else after the wait, :class:`Unavailable` when the broker could not be
        reached or kept answering ``503`` until the wait ran out, :class:`BrokerError` for any
        other refusal (its message names the key, the URL and the status).
        """
        params: Dict[str, Any] = {"mode": "shared"} if shared else {}
        return self._acquire("locks", key, ttl, wait, params, "shared" if shared else "exclusive",
                             owner, auto_renew, renew_every, on_trouble)

    def try_acquire(
        self,
        key: str,
        ttl: float = 30.0,
        *,
        shared: bool = False,
        owner: Optional[str] = None,
        auto_renew: bool = True,
        renew_every: Optional[float] = None,
        on_trouble: Optional[Callable[[Optional[str]], Any]] = None,
    ) -> Optional[Lease]:
        """As :meth:`acquire` without waiting: the lease, or ``None`` when someone else holds
        the key. Raises :class:`Unavailable` when the broker could not answer."""
        try:
            return self.acquire(key, ttl, 0.0, shared=shared, owner=owner,
                                auto_renew=auto_renew, renew_every=renew_every,
                                on_trouble=on_trouble)
        except Locked:
            return None

    # -- semaphores -----------------------------------------------------------------------------

    def acquire_permit(
        self,
        key: str,
        limit: int,
        ttl: float = 30.0,
        wait: float = 0.0,
        *,
        owner: Optional[str] = None,
        auto_renew: bool = True,
        renew_every: Optional[float] = None,
        on_trouble: Optional[Callable[[Optional[str]], Any]] = None,
    ) -> Lease:
        """Takes one of the ``limit`` permits of the semaphore ``key`` (semaphore keys are apart
        from lock keys), waiting up to ``wait`` seconds while all are taken. Every holder must
        use the same ``limit``: another one raises :class:`LimitMismatch`. Otherwise as
        :meth:`acquire`; the lease's ``mode`` is ``"permit"``."""
        if isinstance(limit, bool) or not isinstance(limit, int):
            raise TypeError("limit is an int")
        return self._acquire("semaphores", key, ttl, wait, {"limit": limit}, "permit",
                             owner, auto_renew, renew_every, on_trouble)

    def try_acquire_permit(
        self,
        key: str,
        limit: int,
        ttl: float = 30.0,
        *,
        owner: Optional[str] = None,
        auto_renew: bool = True,
        renew_every: Optional[float] = None,
        on_trouble: Optional[Callable[[Optional[str]], Any]] = None,
    ) -> Optional[Lease]:
        """As :meth:`acquire_permit` without waiting: ``None`` when all permits are taken."""
        try:
            return self.acquire_permit(key, limit, ttl, 0.0, owner=owner,
                                       auto_renew=auto_renew, renew_every=renew_every,
                                       on_trouble=on_trouble)
        except Locked:
            return None

    def acquire_all(self, keys: Iterable[str], ttl: float = 30.0, wait: float = 0.0, *,
                    shared: bool = False, owner: Optional[str] = None, auto_renew: bool = True,
                    renew_every: Optional[float] = None,
                    on_trouble: Optional[Callable[[Optional[str]], Any]] = None) -> Lease:
        """Takes every key of ``keys`` (1 to 64 distinct keys) or none, in one request that
        cannot deadlock with others on the same keys, whatever their order: one lease for all
        (``key``/``fence`` the first key's, ``fences`` a dict key → fence). It renews every key,
        ``release()`` releases them all, and it is lost as a whole when any key is (the others
        are released). Raises :class:`Locked` (its ``busy`` naming the keys held by others) when
        not granted within ``wait``; otherwise as :meth:`acquire`."""
        run = acquire_all_run(self, keys, ttl, wait, shared, owner, auto_renew, renew_every,
                              on_trouble)
        return self._grant(run, lambda args: SeveralLease(self._core, **args),
                           self._register_lease)

    def with_lease(self, key: str, ttl: float, wait: float, work: Callable[[Lease], T],
                   **options: Any) -> T:
        """Runs ``work(lease)`` under a lease on ``key`` (taken as :meth:`acquire` takes it,
        with ``options``) and releases it on the way out, also when ``work`` raises; returns
        what ``work`` returns. A thread cannot be stopped from outside: ``work`` should check
        ``lease.held`` before each write (the asyncio client cancels the work instead)."""
        with self.acquire(key, ttl, wait, **options) as lease:
            return work(lease)

    # -- sessions -------------------------------------------------------------------------------

    def open_session(self, ttl: float = 15.0, lock_delay: float = 0.0, *,
                     owner: Optional[str] = None) -> Session:
        """Opens a session (``POST /sessions``): one keep-alive, every ``ttl/3`` on the renewal
        thread, keeps every lease taken under it (``session.acquire(key, wait)``, ...), and when
        it is lost (no keep-alive confirmed for ``ttl``, or the broker says it ended), all of
        them are. ``lock_delay`` (0 to 60 s): after the session *expires*, its keys are granted
        to nobody for that long (a close or a release has no delay). Retries ``503``s and
        network errors with one ``request_id`` for up to ``timeout``; raises
        :class:`Unavailable` then."""
        run = OpenRun(self.url, ttl, lock_delay, owner if owner is not None else self._owner,
                      self._max_wait, self._core.timeout)
        return self._grant(run, lambda args: Session(self, self._core, **args),
                           self._register_session)

    # -- looking and force release --------------------------------------------------------------

    def inspect(self, key: str, *, semaphore: bool = False) -> KeyView:
        """The lock (or semaphore) ``key`` as it is now (``GET /locks/{key}``): a
        :class:`KeyView` whose ``held`` is false when nobody holds it. Never a token."""
        path, context = inspect_request(self.url, key, semaphore)
        return self._call("GET", path, CallRun(context, self._core.timeout),
                          lambda answer: inspect_view(key, answer, semaphore))

    def list(self, prefix: str = "", *, limit: int = 100, cursor: Optional[str] = None) -> Page:
        """One page of the held locks whose key starts with ``prefix`` (``GET /locks``): a
        :class:`Page` of at most ``limit`` views and the ``next_cursor`` to pass for the next
        page (``None`` after the last)."""
        path, context = list_request(self.url, prefix, limit, cursor)
        return self._call("GET", path, CallRun(context, self._core.timeout), list_page)

    def force_release(self, key: str, *, semaphore: bool = False) -> bool:
        """Ends every lease on ``key`` without its token (``DELETE /locks/{key}?force=true``):
        ``True`` when there were some, ``False`` when nobody held it. Needs an ``admin`` token
        (or, without auth, a broker run with ``--allow-force-release``): else
        :class:`BrokerError` ``403``. Not repeated once it may have reached the broker."""
        path, context = force_request(self.url, key, semaphore)
        return self._call("DELETE", path, CallRun(context, self._core.timeout, repeatable=False),
                          forced)

    def _call(self, method: str, path: str, run: CallRun, outcome: Callable[[Any], Any]) -> Any:
        while True:
            if self._core.closed:
                raise BrokerError("this Broker is closed", code="closed")
            try:
                answer = self._core.transport.request(method, path,
                                                      timeout=run.request_timeout())
            except NoAnswer as e:
                pause = run.no_answer(e)
            else:
                result = outcome(answer)
                if result is not None:
                    return result
                pause = run.retry(answer)
            time.sleep(pause)

    # -- watching -------------------------------------------------------------------------------

    def watch(self, key: str, seen_fence: int = 0, wait: float = 30.0) -> KeyView:
        """One watch of the lock ``key``: answers at once when its holders differ from
        ``seen_fence`` (the fence last seen, ``0`` for free), else at their next change (a
        grant, release, expiry, takeover or force release; a renewal is not one), else when
        ``wait`` seconds pass, with ``changed`` false. Returns a :class:`KeyView` (free:
        ``fence`` is ``None``). ``503``s and lost answers are retried while the wait lasts;
        raises :class:`Unavailable` after it."""
        return watch_once(self._core, self._max_wait, "locks", key, seen_fence, wait)

    def watch_permits(self, key: str, seen_fence: int = 0, wait: float = 30.0) -> KeyView:
        """As :meth:`watch`, for the semaphore ``key``; ``seen_fence`` is the highest permit
        fence seen, and the view's ``holders`` are the permits."""
        return watch_once(self._core, self._max_wait, "semaphores", key, seen_fence, wait)

    def follow(self, key: str, seen_fence: int = 0, *, part: float = 10.0,
               semaphore: bool = False) -> Follower:
        """Every change of the lock (or, with ``semaphore=True``, the semaphore) ``key`` from
        ``seen_fence`` on: iterate the returned :class:`Follower`; ``close()`` it to stop
        (within ``part`` seconds, the length of each watch)."""
        return Follower(self._core, self._max_wait, "semaphores" if semaphore else "locks", key,
                        seen_fence, part)

    # -- the client's life ----------------------------------------------------------------------

    def close(self) -> None:
        """Releases every lease this client still has open (their renewals stop first), then
        closes its connections. Later acquires raise :class:`BrokerError`. Idempotent."""
        with self._core.lock:
            self._core.closed = True
            leases = list(self._core.leases)
            sessions = list(self._core.sessions)
        # One deadline for them all: a broker that cannot be reached costs `timeout` once.
        give_up = time.monotonic() + self._core.timeout
        for session in sessions:
            session._close(give_up)
        for lease in leases:
            try:
                lease._release(give_up)
            except BrokerError as e:
                # No longer renewed, it ends by its ttl.
                log.warning("could not release the lease on %r (fence %d): %s",
                            lease.key, lease.fence, e)
        self._core.renewer.stop()
        self._core.transport.close()

    # -- the acquire loop -----------------------------------------------------------------------

    def _acquire(
        self,
        space: str,
        key: str,
        ttl: float,
        wait: float,
        params: Dict[str, Any],
        mode: str,
        owner: Optional[str],
        auto_renew: bool,
        renew_every: Optional[float],
        on_trouble: Optional[Callable[[Optional[str]], Any]],
    ) -> Lease:
        run = self._acquire_run(space, key, ttl, wait, params, mode, owner, auto_renew,
                                renew_every, on_trouble)
        return self._grant(run, lambda args: Lease(self._core, **args), self._register_lease)

    def _grant(self, run: GrantRun, make: Callable[[Dict[str, Any]], G],
               register: Callable[[G], Optional[BrokerError]]) -> G:
        """The attempts of ``run`` (an acquire, opening a session) until granted: ``make``
        builds what a ``201`` granted, and ``register`` takes it in (or says why it cannot:
        then it is ended and that error raised)."""
        while True:
            if self._core.closed:
                raise BrokerError("this Broker is closed", code="closed")
            body, timeout = run.request()
            try:
                answer = self._core.transport.request("POST", run.path, body=body, timeout=timeout)
            except NoAnswer as e:
                action, delay = "pause", run.no_answer(e)
            else:
                action, delay = run.answered(answer)
            if action == GRANTED:
                made = make(run.args(answer.body))
                if run.needs_confirming():
                    # Granted after a wait, or found again: its end made sure of first.
                    outcome = made._confirm()
                    if outcome == _GONE:
                        run.grant_gone()
                        continue
                    if outcome != _RENEWED and not made._still_live():
                        made._drop()
                        raise run.unconfirmed()
                refusal = register(made)
                if refusal is not None:
                    made._drop()
                    raise refusal
                return made
            if action == AGAIN:
                continue
            time.sleep(run.pause(delay))

    def _register_lease(self, lease: Lease) -> Optional[BrokerError]:
        with self._core.lock:
            if self._core.closed:
                return BrokerError("this Broker is closed", code="closed")
            self._core.leases.add(lease)
        lease._start()
        return None

    def _register_session(self, session: Session) -> Optional[BrokerError]:
        with self._core.lock:
            if self._core.closed:
                return BrokerError("this Broker is closed", code="closed")
            self._core.sessions.add(session)
        session._start()
        return None
