"""What every session keeps, sync or async (:class:`SessionState`): its provable end, its one
keep-alive's decisions, whether it was closed or lost, and the leases taken under it; what a
lease under a session does differently from a plain one (:class:`SessionBound`); and the
attempts of opening one (:class:`OpenRun`).

A session is one heartbeat for many leases: ``POST /sessions/{S}/renew`` every third of its ttl
keeps every lease under it; those leases are not renewed one by one. Its end is counted as a
lease's is (from the sending of the keep-alive the broker last confirmed, less a margin). It is
lost once: a keep-alive answered ``404`` (or refused ``401``/``403``), or its end reached
without a confirmed keep-alive; then every lease under it is lost with it. The secret ``S`` is
never in ``repr``, a log line or an error.
"""

import logging
import threading
import time
import urllib.parse
from typing import Any, Callable, Dict, List, Optional, Tuple

from ._calls import AcquireRun, GrantRun
from ._errors import BrokerError, Unavailable
from ._lease_state import (_GONE, _RENEW, _RENEWED, _RETRY, _STOPPED, _WAIT, EXPIRED, FORBIDDEN,
                           NOT_HELD, NOT_OWNER, UNAUTHORIZED, Backoff, _expires_at, margin_for,
                           state_word, ttl_ms)
from ._transport import RETRYABLE, Answer

log = logging.getLogger("lockbroker")

#: The broker's longest lock delay (api.md: ``lock_delay_ms`` 0 to 60000).
MAX_LOCK_DELAY = 60.0


class OpenRun(GrantRun):
    """The attempts of ``POST /sessions``: retried after ``503``s and failed connections with
    one ``request_id`` (a repeat answers the session a lost answer granted) for up to the
    client's ``timeout``."""

    ordered = False

    def __init__(self, url: str, ttl: float, lock_delay: float, owner: Optional[str],
                 max_wait: float, timeout: float):
        body: Dict[str, Any] = {"ttl_ms": ttl_ms(ttl)}
        if isinstance(lock_delay, bool) or not isinstance(lock_delay, (int, float)):
            raise TypeError(f"lock_delay is a number of seconds, not {type(lock_delay).__name__}")
        if not 0 <= lock_delay <= MAX_LOCK_DELAY:
            raise ValueError(f"lock_delay must be 0 to {MAX_LOCK_DELAY:g} seconds; got {lock_delay!r}")
        body["lock_delay_ms"] = round(lock_delay * 1000)
        if owner is not None:
            body["owner"] = owner
        super().__init__("/sessions", f"opening a session at {url}", body,
                         body["ttl_ms"] / 1000.0, timeout, False, max_wait, timeout)

    def args(self, body: Dict[str, Any], sent_at: Optional[float] = None) -> Dict[str, Any]:
        """The arguments of the session a ``201`` answered."""
        if not isinstance(body.get("session"), str):
            raise BrokerError(f"{self.context}: the broker's answer has no session",
                              status=201, code="bad_response")
        return dict(body=body, ttl=self.ttl, lock_delay=self.body["lock_delay_ms"] / 1000.0,
                    owner=self.body.get("owner"), sent_at=self._sent_at(sent_at))

    def grant_gone(self) -> None:
        """The session ended before its first keep-alive confirmed it: opened again while the
        time lasts, else :class:`Unavailable`."""
        if time.monotonic() >= self.deadline:
            raise Unavailable(f"{self.context}: the session ended before it could be confirmed",
                              code="unreachable")


class SessionState:
    """What every session keeps, sync or async; ``lockbroker.Session`` and
    ``lockbroker.aio.AsyncSession`` add how they send and wait.

    Lock order: a lease's lock may be held while the session's is taken (a lease's ``held``
    asks its session), never the other way round."""

    def __init__(self, client: Any, core: Any, *, body: Dict[str, Any], ttl: float,
                 lock_delay: float, owner: Optional[str], sent_at: float):
        self.ttl = ttl
        delay = body.get("lock_delay_ms")
        self.lock_delay = delay / 1000.0 if isinstance(delay, int) else lock_delay
        answered_owner = body.get("owner")
        self.owner: Optional[str] = answered_owner if isinstance(answered_owner, str) else owner
        self.expires_at = _expires_at(body)
        self._client = client
        self._core = core
        self._id: str = body["session"]
        self._path = "/sessions/" + urllib.parse.quote(self._id, safe="")
        self._lock = threading.Lock()
        self._end = sent_at + ttl - margin_for(ttl)
        self._next_renew = sent_at + ttl * core.renew_fraction
        self._lost_reason: Optional[str] = None
        self._closed = False
        self._callbacks: List[Callable[..., Any]] = []
        #: The leases under it, in the order they were granted (a dict as an ordered set).
        self._leases: Dict[Any, None] = {}
        self._backoff = Backoff()
        self._trouble: Optional[str] = None

    # -- what the application sees ------------------------------------------------------------

    @property
    def alive(self) -> bool:
        """Whether the session provably lives: not closed, not lost, its end (as the client can
        prove it) not reached. Once false, it stays false."""
        with self._lock:
            return self._live_locked(time.monotonic())

    @property
    def lost_reason(self) -> Optional[str]:
        """``None`` while not lost; else ``"not_held"`` (a keep-alive or an acquire was answered
        that the session had ended), ``"unauthorized"``/``"forbidden"`` (a keep-alive was
        refused 401/403) or ``"expired"`` (no keep-alive was confirmed before its end)."""
        with self._lock:
            return self._lost_reason

    @property
    def leases(self) -> List[Any]:
        """The leases taken under this session and not released (nor ended with it)."""
        with self._lock:
            return list(self._leases)

    def __repr__(self) -> str:
        with self._lock:
            state = state_word(self._live_locked(time.monotonic()), "alive",
                               "closed" if self._closed else None, self._lost_reason)
            count = len(self._leases)
        owner = f" owner={self.owner!r}" if self.owner is not None else ""
        return (f"<{type(self).__name__} ttl={self.ttl:g} lock_delay={self.lock_delay:g}{owner}"
                f" leases={count} {state}>")

    # -- acquires under it ----------------------------------------------------------------------

    def _acquire_run(self, space: str, key: str, wait: float, params: Dict[str, Any], mode: str,
                     owner: Optional[str]) -> AcquireRun:
        """An acquire under this session (raises when it is closed or lost)."""
        self._check_usable()
        client = self._client
        return AcquireRun(client.url, space, key, self.ttl, wait, params, mode, owner, None,
                          False, None, client._max_wait, self._core.timeout, session=self._id)

    def _check_usable(self) -> None:
        with self._lock:
            closed, lost = self._closed, self._lost_reason
            live = self._live_locked(time.monotonic())
        if closed:
            raise BrokerError(f"the session at {self._core.url} is closed", code="closed")
        if not live:
            raise BrokerError(f"the session at {self._core.url} was lost ({lost or EXPIRED})",
                              code="no_session")

    def _adopt(self, lease: Any) -> Optional[BrokerError]:
        """Takes in a lease granted under this session; the error to raise (after ending the
        lease) when the session was closed or lost meanwhile."""
        with self._lock:
            if self._live_locked(time.monotonic()):
                self._leases[lease] = None
                return None
        try:
            self._check_usable()
        except BrokerError as e:
            return e
        return BrokerError(f"the session at {self._core.url} ended", code="no_session")

    def _forget(self, lease: Any) -> None:
        with self._lock:
            self._leases.pop(lease, None)

    # -- the keep-alive's decisions -----------------------------------------------------------

    def _next_step(self, now: float) -> Tuple[str, float]:
        """What the keep-alive does at ``now``: stop, lose the session, renew, or wait until the
        returned instant."""
        with self._lock:
            if self._closed or self._lost_reason is not None:
                return _STOPPED, now
            if now >= self._end:
                return EXPIRED, now
            if now >= self._next_renew:
                return _RENEW, now
            return _WAIT, min(self._next_renew, self._end)

    def _begin_keep_alive(self, now: float, confirming: bool) -> Optional[float]:
        """The keep-alive's timeout (never past the session's end, unless ``confirming`` the
        end of a session not handed out yet), or ``None`` when it is closed or lost."""
        with self._lock:
            if self._closed or self._lost_reason is not None:
                return None
            if confirming:
                return self._core.timeout
            return min(self._core.timeout, max(self._end - now, 0.05))

    def _settle(self, sent: float, answer: Optional[Answer], problem: str,
                confirming: bool) -> Tuple[str, Optional[str], str]:
        """What a keep-alive sent at ``sent`` came to: (outcome, the lost reason to apply or
        ``None``, the problem in words)."""
        if answer is None:
            return _RETRY, None, problem
        if answer.status == 200:
            received = time.monotonic()
            with self._lock:
                if self._closed or self._lost_reason is not None:
                    return _GONE, None, "ended"
                if received >= self._end and not confirming:
                    return _GONE, EXPIRED, "confirmed after the session's end"
                self._end = sent + self.ttl - margin_for(self.ttl)
                self._next_renew = sent + self.ttl * self._core.renew_fraction
                self.expires_at = _expires_at(answer.body) or self.expires_at
            return _RENEWED, None, ""
        described = f"HTTP {answer.status}" + (f" {answer.code}" if answer.code else "") + \
            f": {answer.message}"
        if answer.status == 404:
            return _GONE, NOT_HELD, described
        if answer.status in (401, 403):
            return _GONE, UNAUTHORIZED if answer.status == 401 else FORBIDDEN, described
        return _RETRY, None, described  # 503 and the like: tried again until the end

    def _failed(self, answer: Optional[Answer], problem: str) -> None:
        """Books a keep-alive that failed without ending the session: the next try after a
        backoff (or the broker's Retry-After). Logged here (a session has no trouble hook)."""
        delay = self._backoff.delay(answer.retry_after() if answer is not None else None)
        now = time.monotonic()
        with self._lock:
            self._next_renew = now + delay
            first = self._trouble is None
            self._trouble = problem
            ends_in = max(self._end - now, 0.0)
        level = logging.INFO if first else logging.DEBUG
        log.log(level, "keep-alive of a session at %s not confirmed: %s; again in %.2f s "
                "(lost in %.1f s unless one gets through)", self._core.url, problem, delay, ends_in)

    def _recovered(self) -> bool:
        """Books a confirmed keep-alive (``False``: there is no trouble hook to tell)."""
        self._backoff.reset()
        with self._lock:
            self._trouble = None
        return False

    def _next_due(self) -> float:
        with self._lock:
            return min(self._next_renew, self._end)

    def _mark_lost(self, reason: str, problem: Optional[str]
                   ) -> Optional[Tuple[List[Callable[..., Any]], List[Any]]]:
        """Marks the session lost (once; never a closed one): its callbacks and its leases, to
        lose in turn, or ``None`` when it was already lost or closed."""
        with self._lock:
            if self._lost_reason is not None or self._closed:
                return None
            if reason == EXPIRED and problem is None:
                problem = self._trouble
            self._lost_reason = reason
            callbacks, self._callbacks = self._callbacks, []
            leases, self._leases = list(self._leases), {}
        detail = f" ({problem})" if problem else ""
        level = logging.WARNING if reason in (UNAUTHORIZED, FORBIDDEN) else logging.INFO
        log.log(level, "session at %s lost with its %d leases: %s%s", self._core.url,
                len(leases), reason, detail)
        return callbacks, leases

    def _mark_closed(self) -> Optional[Tuple[bool, List[Any]]]:
        """Marks the session closed (once): whether it may still stand at the broker (then the
        ``DELETE`` is sent), and its leases, released with it. ``None`` when already closed."""
        with self._lock:
            if self._closed:
                return None
            self._closed = True
            standing = self._lost_reason != NOT_HELD and \
                time.monotonic() < self._end + margin_for(self.ttl)
            leases, self._leases = list(self._leases), {}
            self._callbacks = []
        return standing, leases

    def _lose(self, reason: str, problem: Optional[str]) -> None:
        """Loses the session (once), then every lease under it: the session's callbacks run
        first, then each lease's."""
        marked = self._mark_lost(reason, problem)
        if marked is None:
            return
        self._core.forget_session(self)
        callbacks, leases = marked
        for callback in callbacks:
            self._run_callback(callback)
        for lease in leases:
            lease._lose(reason, "its session was lost")

    def _run_callback(self, callback: Callable[..., Any]) -> None:
        raise NotImplementedError

    def _closed_answer(self, answer: Optional[Answer], problem: str, give_up: float
                       ) -> Optional[float]:
        """What one ``DELETE /sessions/{S}`` came to: ``None`` when done (ended, already gone,
        or given up: close never raises), else the pause before the next try."""
        if answer is not None:
            if answer.status in (204, 404):
                return None
            if answer.status not in RETRYABLE:
                log.warning("closing a session at %s was refused (HTTP %d: %s); its leases end "
                            "with its ttl", self._core.url, answer.status, answer.message)
                return None
            problem = answer.message
        now = time.monotonic()
        if now >= give_up or now >= self._end + margin_for(self.ttl):
            log.warning("could not close a session at %s (%s); its leases end with its ttl",
                        self._core.url, problem)
            return None
        return min(self._backoff.delay(answer.retry_after() if answer else None), give_up - now)

    def _add_callback(self, callback: Callable[..., Any]) -> bool:
        """Registers a lost callback; ``False`` when the session is lost already (run it now)."""
        if not callable(callback):
            raise TypeError("on_lost takes a callable")
        with self._lock:
            if self._lost_reason is None:
                if not self._closed:
                    self._callbacks.append(callback)
                return True
        return False

    # -- what its leases ask ------------------------------------------------------------------

    def _alive_at(self, now: float) -> bool:
        with self._lock:
            return self._live_locked(now)

    def _gone_by(self, now: float) -> bool:
        """Whether nothing under the session can stand at the broker any more."""
        with self._lock:
            return self._lost_reason == NOT_HELD or now >= self._end + margin_for(self.ttl)

    def _live_locked(self, now: float) -> bool:
        return not self._closed and self._lost_reason is None and now < self._end

    def _still_live(self) -> bool:
        return self.alive


class SessionBound:
    """What a lease taken under a session does differently from a plain one (mixed in before
    the lease class): it is held while its session lives (and it is neither released nor
    lost), it is never renewed on its own, and an explicit ``renew()`` asks the broker whether
    it still stands (the session's end is its end)."""

    _session: SessionState
    _lock: threading.Lock
    _released: bool
    _lost_reason: Optional[str]
    expires_at: Optional[float]

    def _live_locked(self, now: float) -> bool:
        return not self._released and self._lost_reason is None and self._session._alive_at(now)

    def _ended_by(self, now: float) -> bool:
        with self._lock:
            if self._lost_reason in (NOT_HELD, NOT_OWNER):
                return True
        return self._session._gone_by(now)

    def _release_finished(self) -> None:
        super()._release_finished()  # type: ignore[misc]
        self._session._forget(self)

    def _renew_check(self) -> Optional[bool]:
        """Before an explicit renewal: ``False`` when lost (or the session is), raises when
        released."""
        with self._lock:
            if self._released:
                raise BrokerError("the lease was released", code="released")
            if self._lost_reason is not None or not self._session._alive_at(time.monotonic()):
                return False
        return None

    def _renew_answer(self, answer: Optional[Answer], problem: str) -> Tuple[str, Optional[str], str]:
        """What a renewal of a lease under a session came to (see ``SessionState._settle``)."""
        if answer is not None and answer.status == 200:
            self.expires_at = _expires_at(answer.body) or self.expires_at
            return _RENEWED, None, ""
        if answer is not None and answer.status in (404, 409):
            return _GONE, NOT_OWNER if answer.code == "not_owner" else NOT_HELD, \
                f"HTTP {answer.status}: {answer.message}"
        if answer is not None and answer.status in (401, 403):
            return _GONE, UNAUTHORIZED if answer.status == 401 else FORBIDDEN, answer.message
        return _RETRY, None, problem or (answer.message if answer is not None else "")

    def _released_with_session(self) -> None:
        """The session was closed: this lease was released with it (no lost callbacks)."""
        with self._lock:
            self._released = True
            self._release_done = True  # type: ignore[attr-defined]
