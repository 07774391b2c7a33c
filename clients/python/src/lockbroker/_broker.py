"""The client of one broker: acquires locks, shared locks and semaphore permits, and keeps track
of the leases it handed out so that :meth:`Broker.close` ends them.

An acquire is one ``POST`` with a ``request_id`` generated for it; the broker does the waiting.
When the broker answers ``503`` (or a load balancer in front ``502``/``504``) or no answer comes,
the same request is sent again (same ``request_id``) after the broker's ``Retry-After`` or a
short backoff, while the caller's wait lasts. A repeat of a request the broker did grant answers that same lease, so a retry never
makes a second holder, and a grant whose answer was lost is found again, not left behind.
"""

import logging
import secrets
import ssl
import threading
import time
from typing import Any, Dict, Optional, Set

from ._errors import BrokerError, Locked, Unavailable, error_from
from ._lease import (
    _GONE,
    _RENEWED,
    Backoff,
    Lease,
    key_path,
    margin_for,
    ttl_ms,
)
from ._transport import RETRYABLE, NoAnswer, Transport
from ._watch import Follower, KeyView, watch_once

__version__ = "0.1.0"

log = logging.getLogger("lockbroker")

#: The broker's default ``max_wait_ms``: a longer wait is asked for in parts of this length.
DEFAULT_MAX_WAIT = 60.0


class _Core:
    """What a broker's leases share with it: the transport, the settings, the open leases."""

    def __init__(self, transport: Transport, timeout: float, renew_fraction: float):
        self.transport = transport
        self.timeout = timeout
        self.renew_fraction = renew_fraction
        self.lock = threading.Lock()
        self.leases: Set[Lease] = set()
        self.closed = False

    def forget(self, lease: Lease) -> None:
        with self.lock:
            self.leases.discard(lease)


class Broker:
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

    ``close()`` (or leaving a ``with`` block) releases every lease still open and stops their
    renewals.
    """

    def __init__(
        self,
        url: str = "http://127.0.0.1:8080",
        token: Optional[str] = None,
        *,
        timeout: float = 10.0,
        renew_fraction: float = 1.0 / 3.0,
        owner: Optional[str] = None,
        max_wait: float = DEFAULT_MAX_WAIT,
        ssl_context: Optional[ssl.SSLContext] = None,
    ):
        if not 0 < renew_fraction < 1:
            raise ValueError("renew_fraction must be between 0 and 1 (exclusive)")
        if not timeout > 0:
            raise ValueError("timeout must be a positive number of seconds")
        if not max_wait >= 0.001:
            raise ValueError("max_wait must be at least 0.001 s")
        self.url = url
        self._owner = owner
        self._max_wait = float(max_wait)
        transport = Transport(url, token, ssl_context, f"lockbroker-python/{__version__}")
        self._core = _Core(transport, float(timeout), float(renew_fraction))

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
    ) -> Lease:
        """Takes the lock on ``key`` for ``ttl`` seconds, waiting up to ``wait`` seconds while
        someone else holds it (the broker waits; waiters are served in arrival order).
        ``shared=True`` takes a shared (read) lease instead of an exclusive one.

        The lease renews itself every ``renew_every`` seconds (default: a third of ``ttl``)
        until released, unless ``auto_renew=False``.

        Raises :class:`Locked` when still held by someone else after the wait, and
        :class:`Unavailable` when the broker could not be reached or kept answering ``503``
        until the wait ran out.
        """
        params: Dict[str, Any] = {"mode": "shared"} if shared else {}
        return self._acquire("locks", key, ttl, wait, params, "shared" if shared else "exclusive",
                             owner, auto_renew, renew_every)

    def try_acquire(
        self,
        key: str,
        ttl: float = 30.0,
        *,
        shared: bool = False,
        owner: Optional[str] = None,
        auto_renew: bool = True,
        renew_every: Optional[float] = None,
    ) -> Optional[Lease]:
        """As :meth:`acquire` without waiting: the lease, or ``None`` when someone else holds
        the key. Raises :class:`Unavailable` when the broker could not answer."""
        try:
            return self.acquire(key, ttl, 0.0, shared=shared, owner=owner,
                                auto_renew=auto_renew, renew_every=renew_every)
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
    ) -> Lease:
        """Takes one of the ``limit`` permits of the semaphore ``key`` (semaphore keys are apart
        from lock keys), waiting up to ``wait`` seconds while all are taken. Every holder must
        use the same ``limit``: another one raises :class:`LimitMismatch`. Otherwise as
        :meth:`acquire`; the lease's ``mode`` is ``"permit"``."""
        if isinstance(limit, bool) or not isinstance(limit, int):
            raise TypeError("limit is an int")
        return self._acquire("semaphores", key, ttl, wait, {"limit": limit}, "permit",
                             owner, auto_renew, renew_every)

    def try_acquire_permit(
        self,
        key: str,
        limit: int,
        ttl: float = 30.0,
        *,
        owner: Optional[str] = None,
        auto_renew: bool = True,
        renew_every: Optional[float] = None,
    ) -> Optional[Lease]:
        """As :meth:`acquire_permit` without waiting: ``None`` when all permits are taken."""
        try:
            return self.acquire_permit(key, limit, ttl, 0.0, owner=owner,
                                       auto_renew=auto_renew, renew_every=renew_every)
        except Locked:
            return None

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
        # One deadline for them all: a broker that cannot be reached costs `timeout` once.
        give_up = time.monotonic() + self._core.timeout
        for lease in leases:
            try:
                lease._release(give_up)
            except BrokerError as e:
                # No longer renewed, it ends by its ttl.
                log.warning("could not release the lease on %r (fence %d): %s",
                            lease.key, lease.fence, e)
        self._core.transport.close()

    def __enter__(self) -> "Broker":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<Broker url={self.url!r}>"

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
    ) -> Lease:
        path = key_path(space, key)
        body: Dict[str, Any] = dict(params)
        body["ttl_ms"] = ttl_ms(ttl)
        ttl = body["ttl_ms"] / 1000.0
        if isinstance(wait, bool) or not isinstance(wait, (int, float)) or not wait >= 0 \
                or wait == float("inf"):
            raise ValueError(f"wait must be a number of seconds >= 0; got {wait!r}")
        if renew_every is not None:
            ttl_ms(renew_every, "renew_every")
            if renew_every >= ttl - margin_for(ttl):
                raise ValueError("renew_every must be shorter than the ttl (less a tenth)")
        owner = owner if owner is not None else self._owner
        if owner is not None:
            body["owner"] = owner
        # One id for every attempt of this acquire: a repeat of an attempt the broker granted
        # answers that same lease (while it is held), never a second one.
        body["request_id"] = secrets.token_urlsafe(18)
        deadline = time.monotonic() + wait
        backoff = Backoff()
        # When the first attempt that may have reached the broker left: no lease this acquire
        # produced can have begun earlier.
        first_sent: Optional[float] = None
        problem = "no attempt made"
        while True:
            if self._core.closed:
                raise BrokerError("this Broker is closed", code="closed")
            now = time.monotonic()
            ask = min(max(deadline - now, 0.0), self._max_wait)
            body["wait_ms"] = int(ask * 1000)
            try:
                answer = self._core.transport.request(
                    "POST", path, body=body, timeout=ask + self._core.timeout
                )
            except NoAnswer as e:
                if e.sent and first_sent is None:
                    first_sent = now
                answer, problem, delay = None, str(e), backoff.delay()
            else:
                if first_sent is None:
                    first_sent = now
                if answer.status == 201:
                    lease = self._granted(space, key, mode, answer.body, ttl, first_sent,
                                          renew_every, auto_renew)
                    if lease is not None:
                        return lease
                    # The grant was gone (404/409) before it could be confirmed: ask again,
                    # while the wait lasts.
                    if time.monotonic() >= deadline:
                        raise Locked(f"the grant of {key!r} ended before it could be confirmed")
                    continue
                if answer.status == 409 and answer.code == "locked" and \
                        time.monotonic() < deadline - 0.001 and ask < deadline - now:
                    continue  # a wait longer than the broker's longest, asked for in parts
                if answer.status not in RETRYABLE:
                    raise error_from(answer)
                problem, delay = answer.message, backoff.delay(answer.retry_after())
            now = time.monotonic()
            log.debug("acquire of %r not answered: %s; again in %.2f s", key, problem,
                      min(delay, max(deadline - now, 0.0)))
            if now >= deadline:
                raise Unavailable(
                    f"could not acquire {key!r}: {problem}",
                    status=answer.status if answer is not None else None,
                    code=answer.code if answer is not None else "unreachable",
                )
            time.sleep(min(delay, deadline - now))

    def _granted(
        self,
        space: str,
        key: str,
        mode: str,
        body: Dict[str, Any],
        ttl: float,
        first_sent: float,
        renew_every: Optional[float],
        auto_renew: bool,
    ) -> Optional[Lease]:
        """The lease a 201 answered, made sure of: ``None`` if it turned out to be gone."""
        if not isinstance(body.get("token"), str) or not isinstance(body.get("fence"), int):
            raise BrokerError("the broker's grant has no token or fence", status=201,
                              code="bad_response")
        lease = Lease(self._core, space=space, key=key, mode=mode, body=body, ttl=ttl,
                      sent_at=first_sent, renew_every=renew_every, auto_renew=auto_renew)
        now = time.monotonic()
        if now - first_sent > ttl / 3:
            # Granted after a wait, or found again by a retry: the grant happened at some
            # instant since `first_sent`, so the end the client can prove is early. A renewal
            # now gives it an end measured from now.
            outcome, _, _ = lease._renew_once(now, confirming=True)
            if outcome == _GONE:
                return None
            if outcome != _RENEWED and not lease.held:
                # Sure of neither its end nor that it still stands: not returned, and ended
                # if the broker can be reached.
                try:
                    lease.release()
                except BrokerError:
                    pass
                raise Unavailable(f"could not confirm the grant of {key!r} in time",
                                  code="unreachable")
        with self._core.lock:
            if self._core.closed:
                closed = True
            else:
                closed = False
                self._core.leases.add(lease)
        if closed:
            lease.release()
            raise BrokerError("this Broker is closed", code="closed")
        lease._start()
        return lease
