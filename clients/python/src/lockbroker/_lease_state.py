"""What every lease keeps, sync or async (:class:`LeaseState`), and the small pieces the clients
share: the key rule, ttl checks, the retry backoff, and why a lease was lost.

Times are kept on this process's monotonic clock. The end the client believes in is one it can
prove: ``ttl`` after the *sending* of the request the broker last confirmed (the broker granted
or renewed after that instant, so its own end is no earlier), less a small margin that gives the
application a head start. ``held`` turns false at that end, or as soon as a renewal is answered
``404``/``409`` (or refused ``401``/``403``), whichever comes first; the lost callbacks run once.
"""

import inspect
import logging
import random
import re
import threading
import time
import urllib.parse
from typing import Any, Callable, Dict, List, Optional, Tuple

from ._errors import BrokerError, Unavailable, error_from, where
from ._transport import RETRYABLE, Answer

log = logging.getLogger("lockbroker")

#: Why a lease was lost, as :attr:`Lease.lost_reason` gives it.
NOT_HELD = "not_held"
NOT_OWNER = "not_owner"
EXPIRED = "expired"
UNAUTHORIZED = "unauthorized"
FORBIDDEN = "forbidden"

# What one renewal came to.
_RENEWED = "renewed"
_GONE = "gone"
_RETRY = "retry"
_STOPPED = "stopped"
# What the renewal does next (besides _STOPPED and EXPIRED).
_RENEW = "renew"
_WAIT = "wait"

#: The broker's key rule (api.md), checked before anything is sent.
KEY_RULE = "1 to 200 characters from A-Z a-z 0-9 . _ - :"
_KEY = re.compile(r"[A-Za-z0-9._:-]{1,200}")


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


def check_key(key: Any) -> str:
    """``key`` if the broker would take it, else ``ValueError`` naming the rule."""
    if not isinstance(key, str):
        raise TypeError(f"a key is a str, not {type(key).__name__}")
    if not key:
        raise ValueError(f"a key is required ({KEY_RULE})")
    if not _KEY.fullmatch(key):
        raise ValueError(f"bad key {key!r}: a key is {KEY_RULE}")
    return key


def key_path(space: str, key: str) -> str:
    return f"/{space}/{urllib.parse.quote(check_key(key), safe=':')}"


def ttl_ms(seconds: float, what: str = "ttl") -> int:
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)):
        raise TypeError(f"{what} is a number of seconds, not {type(seconds).__name__}")
    if not seconds > 0 or seconds == float("inf"):
        raise ValueError(f"{what} must be a positive number of seconds; got {seconds!r}")
    return max(1, round(seconds * 1000))


class LeaseState:
    """What every lease keeps, sync or async: what was granted, its provable end, when it renews
    next, whether it was released or lost, and the decisions of its renewal (what to do now,
    what an answer means). The sync :class:`Lease` and ``lockbroker.aio.AsyncLease`` add how
    they send and wait."""

    def __init__(
        self,
        core: Any,
        *,
        space: str,
        key: str,
        mode: str,
        body: Dict[str, Any],
        ttl: float,
        sent_at: float,
        renew_every: Optional[float],
        auto_renew: bool,
        on_trouble: Optional[Callable[..., Any]],
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
        self._on_trouble = on_trouble
        self._lock = threading.Lock()
        self._end = sent_at + ttl - margin_for(ttl)
        self._next_renew = sent_at + self._interval()
        self._lost_reason: Optional[str] = None
        self._callbacks: List[Callable[..., Any]] = []
        self._released = False
        self._release_done = False
        self._backoff = Backoff()
        # The problem of the renewal that failed last, while renewals fail (else None).
        self._trouble: Optional[str] = None

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
        answered 404/409: the lease had ended, or someone else holds the key now),
        ``"unauthorized"`` or ``"forbidden"`` (a renewal was refused 401/403: the token was
        revoked or lost its rights), or ``"expired"`` (no renewal was confirmed before its end:
        the broker was unreachable or kept answering 503)."""
        with self._lock:
            return self._lost_reason

    def __repr__(self) -> str:
        with self._lock:
            state = state_word(self._live_locked(time.monotonic()), "held",
                               "released" if self._released else None, self._lost_reason)
        return (
            f"<{type(self).__name__} key={self.key!r} fence={self.fence} mode={self.mode!r}"
            + (f" limit={self.limit}" if self.limit is not None else "")
            + f" ttl={self.ttl:g} {state}>"
        )

    # -- the renewal's decisions --------------------------------------------------------------

    def _next_step(self, now: float) -> Tuple[str, float]:
        """What the renewal does at ``now``: stop (released or lost), lose it (its end came),
        renew, or wait until the returned instant."""
        with self._lock:
            if self._released or self._lost_reason is not None:
                return _STOPPED, now
            if now >= self._end:
                return EXPIRED, now
            due = self._next_renew if self._auto_renew else float("inf")
            if now >= due:
                return _RENEW, now
            return _WAIT, min(due, self._end)

    def _begin_renewal(self, now: float, confirming: bool) -> Optional[Tuple[float, float]]:
        """Under the lock: the ttl to ask for and the request's timeout, or ``None`` when the
        lease was released (no renewal starts after a release began)."""
        if self._released:
            return None
        # Never waiting past the lease's end: the lost signal must not be late for an answer.
        # ``confirming``: the renewal that fixes the end of a lease not yet handed out (see
        # ``_granted``); its end may have passed, as nobody has been told it is held.
        timeout = self._core.timeout if confirming else \
            min(self._core.timeout, max(self._end - now, 0.05))
        return self.ttl, timeout

    def _settle(self, sent: float, ttl: float, answer: Optional[Answer], problem: str,
                confirming: bool) -> Tuple[str, Optional[str], str]:
        """What a renewal sent at ``sent`` for ``ttl`` came to: (outcome, the lost reason to
        apply or ``None``, the problem in words)."""
        if answer is None:
            return _RETRY, None, problem
        if answer.status == 200:
            received = time.monotonic()
            with self._lock:
                if self._lost_reason is not None:
                    return _GONE, None, "lost"
                if received >= self._end and not confirming:
                    # `held` may already have said false: it must not turn true again.
                    return _GONE, EXPIRED, "confirmed after the lease's end"
                self._end = sent + ttl - margin_for(ttl)
                self._next_renew = sent + self._interval()
                self.expires_at = _expires_at(answer.body)
            return _RENEWED, None, ""
        described = f"HTTP {answer.status}" + (f" {answer.code}" if answer.code else "") + \
            f": {answer.message}"
        if answer.status in (404, 409):
            return _GONE, NOT_OWNER if answer.code == "not_owner" else NOT_HELD, described
        if answer.status in (401, 403):
            # The token was revoked or lost its rights to the key: no renewal will get through.
            return _GONE, UNAUTHORIZED if answer.status == 401 else FORBIDDEN, described
        # 503 and the like; also a 400 or 500 nobody expects: tried again until the end.
        return _RETRY, None, described

    def _failed(self, answer: Optional[Answer], problem: str) -> Optional[str]:
        """Books a renewal that failed without ending the lease: the next try after a backoff
        (or the broker's Retry-After). Returns the description for the trouble hook when this
        failure starts a streak, else ``None``."""
        delay = self._backoff.delay(answer.retry_after() if answer is not None else None)
        now = time.monotonic()
        with self._lock:
            self._next_renew = now + delay
            first = self._trouble is None
            self._trouble = problem
            ends_in = max(self._end - now, 0.0)
        log.debug("renewal of %r (fence %d) not confirmed: %s; again in %.2f s",
                  self.key, self.fence, problem, delay)
        if not first:
            return None
        return (f"renewal of {self.key!r} (fence {self.fence}) at {self._core.url} failed: "
                f"{problem}; the lease is lost in {ends_in:.1f} s unless a renewal gets through")

    def _recovered(self) -> bool:
        """Books a confirmed renewal; whether it ended a streak of failed ones."""
        self._backoff.reset()
        with self._lock:
            was, self._trouble = self._trouble, None
        return was is not None

    def _mark_lost(self, reason: str, problem: Optional[str]) -> Optional[List[Callable[..., Any]]]:
        """Marks the lease lost (once; never a released one) and returns the callbacks to run,
        or ``None`` when it was already lost or released."""
        with self._lock:
            if self._lost_reason is not None or self._released:
                return None
            if reason == EXPIRED and problem is None:
                problem = self._trouble
            self._lost_reason = reason
            callbacks, self._callbacks = self._callbacks, []
        detail = f" ({problem})" if problem else ""
        if reason in (UNAUTHORIZED, FORBIDDEN):
            log.warning("lease on %r (fence %d) at %s lost: its renewal was refused%s",
                        self.key, self.fence, self._core.url, detail)
        else:
            log.info("lease on %r (fence %d) lost: %s%s", self.key, self.fence, reason, detail)
        return callbacks

    def _add_callback(self, callback: Callable[..., Any]) -> bool:
        """Registers a lost callback; ``False`` when the lease is lost already (run it now)."""
        if not callable(callback):
            raise TypeError("on_lost takes a callable")
        with self._lock:
            if self._lost_reason is None:
                self._callbacks.append(callback)
                return True
        return False

    def _next_due(self) -> float:
        with self._lock:
            due = self._next_renew if self._auto_renew else float("inf")
            return min(due, self._end)

    # -- the release's decisions --------------------------------------------------------------

    def _deleted(self, answer: Optional[Answer], problem: str, give_up: float) -> Tuple[bool, float]:
        """What one ``DELETE`` came to: (done, the pause before the next try). Raises for a
        refusal, and :class:`Unavailable` when ``give_up`` passed with the lease maybe
        standing."""
        if answer is not None:
            if answer.status in (204, 404, 409):
                return True, 0.0
            if answer.status not in RETRYABLE:
                raise error_from(answer, where("release of", self.key, self._core.url))
            problem = answer.message
        now = time.monotonic()
        if self._ended_by(now):
            return True, 0.0  # nothing left to end
        if now >= give_up:
            raise Unavailable(
                f"could not release the lease on {self.key!r} at {self._core.url}: {problem}; "
                "it ends by its ttl",
                status=answer.status if answer is not None else None,
                code="unreachable",
            )
        return False, min(self._backoff.delay(answer.retry_after() if answer else None),
                          give_up - now)

    def _renew_paths(self) -> List[str]:
        """Where a renewal goes: one ``POST`` per key (a several-keys lease has more)."""
        return [self._path + "/renew"]

    def _release_path(self) -> str:
        return self._path

    def _release_answer(self, answer: Optional[Answer]) -> Optional[Answer]:
        """The release's answer as the single-key answer would be (see ``_several``)."""
        return answer

    def _release_finished(self) -> None:
        with self._lock:
            self._release_done = True
        self._core.forget(self)

    def _renew_args(self, ttl: Optional[float]) -> Optional[bool]:
        """The checks of an explicit ``renew(ttl)``: ``False`` when lost; raises when released."""
        if ttl is not None:
            ttl_ms(ttl)
        with self._lock:
            if self._released:
                raise BrokerError("the lease was released", code="released")
            if self._lost_reason is not None:
                return False
            if ttl is not None:
                self.ttl = float(ttl)
        return None

    def _renew_result(self, outcome: str, answer: Optional[Answer], problem: str) -> bool:
        if outcome == _RENEWED:
            return True
        if outcome == _GONE:
            return False
        if outcome == _STOPPED:
            raise BrokerError("the lease was released", code="released")
        raise Unavailable(f"could not renew {self.key!r} at {self._core.url}: {problem}",
                          status=answer.status if answer else None, code="unreachable")

    def _release_failed_on_exit(self, exc_type: Any, e: BrokerError) -> None:
        """Leaving a ``with`` block whose release failed: the block's work is done and the lease
        is no longer renewed (it ends by its ttl), so an :class:`Unavailable` is logged, not
        raised; a refusal is raised unless the block's own exception is on its way."""
        if isinstance(e, Unavailable) or exc_type is not None:
            log.warning("could not release the lease on %r (fence %d): %s", self.key, self.fence, e)
            return
        raise e

    # -- helpers ------------------------------------------------------------------------------

    def _still_live(self) -> bool:
        return self.held

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


def state_word(live: bool, live_word: str, ended_by_caller: Optional[str],
               lost_reason: Optional[str]) -> str:
    """How ``repr`` says where a lease or a session stands."""
    if live:
        return live_word
    if ended_by_caller is not None:
        return ended_by_caller
    if lost_reason is not None:
        return f"lost ({lost_reason})"
    return "ended"


def earlier(kept: Optional[Answer], answer: Answer) -> Answer:
    """Of two renewals' answers, the one whose lease ends first (``kept`` may be ``None``)."""
    if kept is None:
        return answer
    ends = [a.body.get("expires_at_ms") for a in (kept, answer)]
    if all(isinstance(end, int) for end in ends) and ends[1] < ends[0]:
        return answer
    return kept


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
