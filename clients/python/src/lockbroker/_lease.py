"""A lease the broker granted: its key, fence and token (kept inside), the thread that renews it,
the moment it stops being held (the lost signal), and its release.

Times are kept on this process's monotonic clock. The end the client believes in is one it can
prove: ``ttl`` after the *sending* of the request the broker last confirmed (the broker granted
or renewed after that instant, so its own end is no earlier), less a small margin that gives the
application a head start. ``held`` turns false at that end, or as soon as a renewal is answered
``404``/``409``, whichever comes first; the lost callbacks run once, on the lease's thread.
"""

import inspect
import logging
import random
import threading
import time
import urllib.parse
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional

from ._errors import BrokerError, Unavailable, error_from
from ._transport import RETRYABLE, Answer, NoAnswer

if TYPE_CHECKING:
    from ._broker import _Core

log = logging.getLogger("lockbroker")

#: Why a lease was lost, as :attr:`Lease.lost_reason` gives it.
NOT_HELD = "not_held"
NOT_OWNER = "not_owner"
EXPIRED = "expired"

# What one renewal came to.
_RENEWED = "renewed"
_GONE = "gone"
_RETRY = "retry"
_STOPPED = "stopped"


def margin_for(ttl: float) -> float:
    """How long before its provable end a lease counts as lost: a tenth of its ttl, at most 1 s,
    so that the application hears of the loss while the lease still stands."""
    return min(ttl / 10.0, 1.0)


class Backoff:
    """Delays between retries when the broker gave no ``Retry-After``: 50 ms doubling to 1 s,
    jittered so that many clients do not retry in step."""

    def __init__(self) -> None:
        self._next = 0.05

    def delay(self, retry_after: Optional[float] = None) -> float:
        if retry_after is not None:
            return retry_after
        delay = self._next * random.uniform(0.5, 1.0)
        self._next = min(self._next * 2, 1.0)
        return delay

    def reset(self) -> None:
        self._next = 0.05


def key_path(space: str, key: str) -> str:
    if not isinstance(key, str):
        raise TypeError(f"a key is a str, not {type(key).__name__}")
    # Every character outside the key alphabet is escaped, so that a bad key reaches the broker
    # as one path segment and is answered 400 with the broker's reason, never routed elsewhere.
    return f"/{space}/{urllib.parse.quote(key, safe=':')}"


def ttl_ms(seconds: float, what: str = "ttl") -> int:
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)):
        raise TypeError(f"{what} is a number of seconds, not {type(seconds).__name__}")
    if not seconds > 0 or seconds == float("inf"):
        raise ValueError(f"{what} must be a positive number of seconds; got {seconds!r}")
    return max(1, round(seconds * 1000))


class Lease:
    """One lease: an exclusive or shared lock, or a semaphore permit.

    Attributes: ``key``, ``fence`` (int, strictly greater than every fence granted before for
    the key: pass it to the resource you write), ``mode`` (``"exclusive"``, ``"shared"`` or
    ``"permit"``), ``limit`` (the semaphore's, or ``None``), ``ttl`` (seconds), ``expires_at``
    (Unix time in seconds on the broker's store clock, as last granted or renewed).

    The token that proves ownership stays inside: it is never in ``repr``, a log line or an
    error. Whoever has this object may renew and release it, from any thread.
    """

    def __init__(
        self,
        core: "_Core",
        *,
        space: str,
        key: str,
        mode: str,
        body: Dict[str, Any],
        ttl: float,
        sent_at: float,
        renew_every: Optional[float],
        auto_renew: bool,
    ):
        self.key = key
        self.mode = mode
        self.fence = int(body["fence"])
        limit = body.get("limit")
        self.limit: Optional[int] = limit if isinstance(limit, int) else None
        self.ttl = ttl
        self.expires_at = _expires_at(body)
        self._core = core
        self._path = key_path(space, key)
        self._token: str = body["token"]
        self._renew_every = renew_every
        self._auto_renew = auto_renew
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._end = sent_at + ttl - margin_for(ttl)
        self._next_renew = sent_at + self._interval()
        self._lost_reason: Optional[str] = None
        self._callbacks: List[Callable[..., Any]] = []
        self._released = False
        self._release_done = False
        self._thread: Optional[threading.Thread] = None

    # -- what the application sees ------------------------------------------------------------

    @property
    def held(self) -> bool:
        """Whether this lease is still provably held: not released, not lost, and its end (as
        the client can prove it) not reached. Once false, it stays false."""
        with self._lock:
            return self._live_locked(time.monotonic())

    @property
    def lost_reason(self) -> Optional[str]:
        """``None`` while not lost; else ``"not_held"`` or ``"not_owner"`` (a renewal was
        answered 404/409: the lease had ended, or someone else holds the key now), or
        ``"expired"`` (no renewal was confirmed before its end: the broker was unreachable or
        kept answering 503)."""
        with self._lock:
            return self._lost_reason

    def on_lost(self, callback: Callable[..., Any]) -> None:
        """Registers ``callback`` to run once when the lease is lost, on a client thread. It
        is called with the lease if it takes an argument, else with none. A callback registered
        after the loss runs at once, in this call. A released lease is not lost: its callbacks
        never run."""
        if not callable(callback):
            raise TypeError("on_lost takes a callable")
        with self._lock:
            if self._lost_reason is None:
                self._callbacks.append(callback)
                return
        self._run_callback(callback)

    def renew(self, ttl: Optional[float] = None) -> bool:
        """Renews the lease now (the auto-renewal does this by itself; this is for leases taken
        with ``auto_renew=False``), for ``ttl`` seconds or the lease's own ttl. Returns ``True``
        when renewed, ``False`` when the lease is lost (then the lost callbacks run). Raises
        :class:`Unavailable` when the broker did not confirm, :class:`BrokerError` when the
        lease was released."""
        if ttl is not None:
            ttl_ms(ttl)
        with self._lock:
            if self._released:
                raise BrokerError("the lease was released", code="released")
            if self._lost_reason is not None:
                return False
            if ttl is not None:
                self.ttl = float(ttl)
        outcome, answer, problem = self._renew_once(time.monotonic())
        if outcome == _RENEWED:
            return True
        if outcome == _GONE:
            return False
        if outcome == _STOPPED:
            raise BrokerError("the lease was released", code="released")
        raise Unavailable(problem, status=answer.status if answer else None, code="unreachable")

    def release(self) -> None:
        """Ends the lease: stops its renewals for good (waiting for one under way), then
        ``DELETE``s it, retrying ``503``s and network errors for up to the broker's ``timeout``.
        Idempotent; quiet when the broker says the lease had already ended (``404``/``409``) or
        when its end has passed. Raises :class:`Unavailable` when the lease may still stand and
        the broker could not be reached to end it (it then ends by its ttl, as it is no longer
        renewed), :class:`BrokerError` for a refusal such as ``403``."""
        self._release(time.monotonic() + self._core.timeout)

    def _release(self, give_up: float) -> None:
        with self._lock:
            if self._release_done:
                return
            self._released = True
            self._cond.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()
        self._delete(give_up)

    def close(self) -> None:
        """The same as :meth:`release`."""
        self.release()

    def __enter__(self) -> "Lease":
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        try:
            self.release()
        except Unavailable as e:
            # The block's work is done and the lease is no longer renewed: it ends by its ttl.
            # Failing the block for it would turn finished work into an error.
            log.warning("could not release the lease on %r (fence %d): %s", self.key, self.fence, e)
        except BrokerError as e:
            if exc_type is None:
                raise
            # The block's own exception matters more.
            log.warning("could not release the lease on %r (fence %d): %s", self.key, self.fence, e)

    def __repr__(self) -> str:
        with self._lock:
            if self._live_locked(time.monotonic()):
                state = "held"
            elif self._released:
                state = "released"
            elif self._lost_reason is not None:
                state = f"lost ({self._lost_reason})"
            else:
                state = "ended"
        return (
            f"<Lease key={self.key!r} fence={self.fence} mode={self.mode!r}"
            + (f" limit={self.limit}" if self.limit is not None else "")
            + f" ttl={self.ttl:g} {state}>"
        )

    # -- the lease's thread -------------------------------------------------------------------

    def _start(self) -> None:
        thread = threading.Thread(
            target=self._run, name=f"lockbroker-lease-{self.key}-{self.fence}", daemon=True
        )
        self._thread = thread
        thread.start()

    def _run(self) -> None:
        backoff = Backoff()
        while True:
            with self._cond:
                action = self._wait_for_action()
            if action == _STOPPED:
                return
            if action == EXPIRED:
                self._lose(EXPIRED)
                return
            outcome, answer, problem = self._renew_once(time.monotonic())
            if outcome == _RENEWED:
                backoff.reset()
                continue
            if outcome in (_GONE, _STOPPED):
                return
            delay = backoff.delay(answer.retry_after() if answer is not None else None)
            log.debug("renewal of %r (fence %d) not confirmed: %s; again in %.2f s",
                      self.key, self.fence, problem, delay)
            with self._lock:
                self._next_renew = time.monotonic() + delay

    def _wait_for_action(self) -> str:
        """Under the lock: sleeps until a renewal is due or the lease's end comes, and says
        which; or that the lease was released or lost meanwhile."""
        while True:
            if self._released or self._lost_reason is not None:
                return _STOPPED
            now = time.monotonic()
            if now >= self._end:
                return EXPIRED
            due = self._next_renew if self._auto_renew else float("inf")
            if now >= due:
                return "renew"
            self._cond.wait(min(due, self._end) - now)

    def _renew_once(self, now: float, confirming: bool = False):
        """One renewal request, sent at ``now``. Returns (outcome, answer or None, problem).

        ``confirming``: the renewal that fixes the end of a lease not yet handed out (see
        ``Broker._granted``); its end may have passed, as nobody has been told it is held.
        """
        with self._lock:
            # Checked under the lock, as `release` sets it under the lock before waiting for
            # this thread: no renewal starts after a release began.
            if self._released:
                return _STOPPED, None, "released"
            ttl = self.ttl
            end = self._end
        # Never waiting past the lease's end: the lost signal must not be late for an answer.
        timeout = self._core.timeout if confirming else min(self._core.timeout, max(end - now, 0.05))
        try:
            answer = self._core.transport.request(
                "POST",
                self._path + "/renew",
                body={"ttl_ms": ttl_ms(ttl)},
                headers={"Lock-Token": self._token},
                timeout=timeout,
            )
        except NoAnswer as e:
            return _RETRY, None, str(e)
        if answer.status == 200:
            received = time.monotonic()
            with self._cond:
                if self._lost_reason is not None:
                    return _GONE, answer, "lost"
                if received >= self._end and not confirming:
                    late = True
                else:
                    late = False
                    self._end = now + ttl - margin_for(ttl)
                    self._next_renew = now + self._interval()
                    self.expires_at = _expires_at(answer.body)
                    self._cond.notify_all()
            if late:
                # `held` may already have said false: it must not turn true again.
                self._lose(EXPIRED)
                return _GONE, answer, "confirmed after the lease's end"
            return _RENEWED, answer, ""
        if answer.status in (404, 409):
            self._lose(NOT_OWNER if answer.code == "not_owner" else NOT_HELD)
            return _GONE, answer, answer.message
        if answer.status not in RETRYABLE:
            # 401/403 (the auth file changed?), 400: kept trying until the end, as a refusal
            # that lasts until then loses the lease anyway.
            log.warning("renewal of %r (fence %d) refused with HTTP %d: %s",
                        self.key, self.fence, answer.status, answer.message)
        return _RETRY, answer, answer.message

    def _lose(self, reason: str) -> None:
        with self._cond:
            if self._lost_reason is not None or self._released:
                return
            self._lost_reason = reason
            callbacks, self._callbacks = self._callbacks, []
            self._cond.notify_all()
        log.info("lease on %r (fence %d) lost: %s", self.key, self.fence, reason)
        for callback in callbacks:
            self._run_callback(callback)

    def _run_callback(self, callback: Callable[..., Any]) -> None:
        try:
            if _takes_an_argument(callback):
                callback(self)
            else:
                callback()
        except Exception:
            log.exception("an on_lost callback of the lease on %r raised", self.key)

    # -- helpers ------------------------------------------------------------------------------

    def _live_locked(self, now: float) -> bool:
        return not self._released and self._lost_reason is None and now < self._end

    def _interval(self) -> float:
        if self._renew_every is not None:
            return self._renew_every
        return self.ttl * self._core.renew_fraction

    def _ended_by(self, now: float) -> bool:
        """Whether the lease can no longer stand at the broker (its end, plus the margin the
        client keeps, has passed) or is known gone."""
        with self._lock:
            return self._lost_reason in (NOT_HELD, NOT_OWNER) or now >= self._end + margin_for(self.ttl)

    def _delete(self, give_up: float) -> None:
        backoff = Backoff()
        while True:
            now = time.monotonic()
            try:
                answer: Optional[Answer] = self._core.transport.request(
                    "DELETE",
                    self._path,
                    headers={"Lock-Token": self._token},
                    timeout=max(give_up - now, 0.05),
                )
            except NoAnswer as e:
                answer, problem = None, str(e)
            else:
                if answer.status in (204, 404, 409):
                    break
                if answer.status not in RETRYABLE:
                    raise error_from(answer)
                problem = answer.message
            now = time.monotonic()
            if self._ended_by(now):
                break  # nothing left to end
            if now >= give_up:
                raise Unavailable(
                    f"could not release the lease on {self.key!r}: {problem}; it ends by its ttl",
                    status=answer.status if answer is not None else None,
                    code="unreachable",
                )
            time.sleep(min(backoff.delay(answer.retry_after() if answer else None), give_up - now))
        with self._lock:
            self._release_done = True
        self._core.forget(self)


def _expires_at(body: Dict[str, Any]) -> Optional[float]:
    ms = body.get("expires_at_ms")
    return ms / 1000.0 if isinstance(ms, int) else None


def _takes_an_argument(callback: Callable[..., Any]) -> bool:
    try:
        signature = inspect.signature(callback)
    except (TypeError, ValueError):
        return False
    try:
        signature.bind(None)
    except TypeError:
        return False
    return True
