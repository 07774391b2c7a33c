"""What the sync and the asyncio client share about their calls: the decisions of an acquire
(what to send next, what an answer means, when to give up) and of the plain calls (inspect, list,
force release), so that each client only adds how it sends and how it waits.

An acquire is one ``POST`` with a ``request_id`` generated for it; the broker does the waiting.
When the broker answers ``503`` (or something in front ``429``/``502``/``504``) or no answer
comes, the same request is sent again (same ``request_id``) after the broker's ``Retry-After``
or a short backoff, while the caller's wait lasts. A repeat of a request the broker did grant
answers that same lease, so a retry never makes a second holder, and a grant whose answer was
lost is found again, not left behind. Any other status is an error at once.
"""

import logging
import secrets
import time
import urllib.parse
from typing import Any, Dict, List, NamedTuple, Optional, Tuple

from ._errors import BrokerError, Locked, Unavailable, error_from, where
from ._lease_state import Backoff, key_path, margin_for, ttl_ms
from ._transport import RETRYABLE, Answer, NoAnswer
from ._watch import KeyView, check_wait

log = logging.getLogger("lockbroker")

# What an acquire does after an answer.
GRANTED = "granted"
AGAIN = "again"
PAUSE = "pause"


class GrantRun:
    """The attempts of one call that grants something (an acquire, opening a session): one
    ``request_id`` for them all, the caller's deadline, the backoff between attempts, and
    whether an attempt may have reached the broker (then it may have granted). ``waits``: the
    call asks the broker to wait (``wait_ms``, in parts of at most ``max_wait``); else each
    attempt may take what is left of the deadline."""

    #: Acquires of one path leave in call order (see the asyncio transport); opening does not.
    ordered = True

    def __init__(self, path: str, context: str, body: Dict[str, Any], ttl: float, wait: float,
                 waits: bool, max_wait: float, timeout: float):
        self.path = path
        self.context = context
        self.ttl = ttl
        # One id for every attempt: a repeat of an attempt the broker granted answers that same
        # grant (while it stands), never a second one.
        body["request_id"] = secrets.token_urlsafe(18)
        self.body = body
        self._waits = waits
        self._max_wait = max_wait
        self._timeout = timeout
        self.deadline = time.monotonic() + check_wait(wait)
        self._backoff = Backoff()
        #: When the first attempt that may have reached the broker left: nothing this call
        #: was granted can have begun earlier.
        self.first_sent: Optional[float] = None
        # Whether an attempt reached the broker, or may have (then it may have granted), and
        # whether one is under way, its bytes leaving (its fate unknown: `sending`).
        self._reached = False
        self._in_flight = False
        self._asked = 0.0
        self._asked_at = 0.0
        self._answer: Optional[Answer] = None
        self._problem = "no attempt made"

    def request(self) -> Tuple[Dict[str, Any], float]:
        """The next attempt's body and timeout (the wait asked for plus the client's timeout;
        for a call that does not wait, what is left of the deadline)."""
        now = time.monotonic()
        self._asked_at = now
        if not self._waits:
            return self.body, max(self.deadline - now, 0.05)
        self._asked = min(max(self.deadline - now, 0.0), self._max_wait)
        self.body["wait_ms"] = int(self._asked * 1000)
        return self.body, self._asked + self._timeout

    def again_body(self) -> Dict[str, Any]:
        """The body that asks again, without waiting, whether this call was granted."""
        return dict(self.body, wait_ms=0) if self._waits else dict(self.body)

    def sending(self) -> None:
        """Books that the attempt's bytes are about to leave (the transport calls it just
        before its first write): from here the broker may grant it. Before, while the
        attempt waits its turn or connects, nothing of it can reach the broker."""
        self._in_flight = True

    @property
    def may_have_reached(self) -> bool:
        """Whether the broker may have granted this call: an attempt reached it, may have
        (no answer after sending), or is under way."""
        return self._reached or self._in_flight

    def no_answer(self, e: NoAnswer) -> float:
        """Books an attempt that got no answer; the pause before the next."""
        self._in_flight = False
        if e.sent:
            self._reached = True
        if e.sent and self.first_sent is None:
            self.first_sent = self._asked_at
        self._answer, self._problem = None, str(e)
        return self._backoff.delay()

    def answered(self, answer: Answer) -> Tuple[str, float]:
        """What to do after ``answer``: (GRANTED, 0), (AGAIN, 0) or (PAUSE, delay). Raises the
        error an answer that ends the call stands for."""
        self._in_flight = False
        self._reached = True
        if self.first_sent is None:
            self.first_sent = self._asked_at
        if answer.status == 201:
            return GRANTED, 0.0
        if self._waits and answer.status == 409 and answer.code == "locked" and \
                time.monotonic() < self.deadline - 0.001 and \
                self._asked < self.deadline - self._asked_at:
            return AGAIN, 0.0  # a wait longer than the broker's longest, asked for in parts
        if answer.status not in RETRYABLE:
            raise error_from(answer, self.context)
        self._answer = answer
        self._problem = f"HTTP {answer.status}: {answer.message}"
        return PAUSE, self._backoff.delay(answer.retry_after())

    def pause(self, delay: float) -> float:
        """How long to wait before the next attempt; raises :class:`Unavailable` when the wait
        has run out."""
        now = time.monotonic()
        if now >= self.deadline:
            answer = self._answer
            raise Unavailable(
                f"{self.context}: {self._problem}",
                status=answer.status if answer is not None else None,
                code=answer.code if answer is not None else "unreachable",
            )
        pause = min(delay, self.deadline - now)
        log.debug("%s not answered: %s; again in %.2f s", self.context, self._problem, pause)
        return pause

    def grant_gone(self) -> None:
        """The grant was gone (404/409) before it could be confirmed: asked again while the wait
        lasts, else :class:`Locked`."""
        if time.monotonic() >= self.deadline:
            raise Locked(f"{self.context}: the grant ended before it could be confirmed")

    def needs_confirming(self) -> bool:
        """Granted after a wait, or found again by a retry: the grant happened at some instant
        since ``first_sent``, so the end the client can prove is early. A renewal now gives it
        an end measured from now."""
        assert self.first_sent is not None
        return time.monotonic() - self.first_sent > self.ttl / 3

    def unconfirmed(self) -> Unavailable:
        return Unavailable(f"{self.context}: could not confirm the grant in time",
                           code="unreachable")

    def _sent_at(self, sent_at: Optional[float]) -> float:
        if sent_at is not None:
            return sent_at
        assert self.first_sent is not None
        return self.first_sent


class AcquireRun(GrantRun):
    """The attempts of one acquire of ``key`` in ``space`` (``locks`` or ``semaphores``).
    Under a session (``session``: its secret), no ``ttl_ms`` is sent: the lease lives as long
    as the session (whose ttl ``ttl`` is), is not renewed on its own, and needs no
    confirming."""

    def __init__(self, url: str, space: str, key: str, ttl: float, wait: float,
                 params: Dict[str, Any], mode: str, owner: Optional[str],
                 renew_every: Optional[float], auto_renew: bool, on_trouble: Any,
                 max_wait: float, timeout: float, session: Optional[str] = None):
        body: Dict[str, Any] = dict(params)
        if session is None:
            body["ttl_ms"] = ttl_ms(ttl)
            ttl = body["ttl_ms"] / 1000.0
        else:
            body["session"] = session
        if renew_every is not None:
            ttl_ms(renew_every, "renew_every")
            if renew_every >= ttl - margin_for(ttl):
                raise ValueError("renew_every must be shorter than the ttl (less a tenth)")
        if owner is not None:
            body["owner"] = owner
        path, context = self._target(url, space, key)
        super().__init__(path, context, body, ttl, wait, True, max_wait, timeout)
        self.key = key
        self._session = session is not None
        self._lease_args = dict(space=space, key=key, mode=mode, ttl=self.ttl,
                                renew_every=renew_every, auto_renew=auto_renew,
                                on_trouble=on_trouble)

    def _target(self, url: str, space: str, key: Any) -> Tuple[str, str]:
        """Where the acquire goes, and how its errors start."""
        return key_path(space, key), where("acquire of", key, url)

    def args(self, body: Dict[str, Any], sent_at: Optional[float] = None) -> Dict[str, Any]:
        """The arguments of the lease a ``201`` answered (sent at ``first_sent`` unless
        ``sent_at`` is given)."""
        if not isinstance(body.get("token"), str) or not isinstance(body.get("fence"), int):
            raise BrokerError(f"{self.context}: the broker's grant has no token or fence",
                              status=201, code="bad_response")
        return dict(self._lease_args, body=body, sent_at=self._sent_at(sent_at))

    def needs_confirming(self) -> bool:
        return not self._session and super().needs_confirming()


class Page(NamedTuple):
    """One page of ``list``: the held locks (as :class:`KeyView`, each ``changed`` false) and
    the cursor of the next page (``None`` after the last)."""

    locks: List[KeyView]
    next_cursor: Optional[str]


class CallRun:
    """A plain call (inspect, list, force release), repeated after ``503``-like answers and
    failed connections for up to ``timeout``; one that may have reached the broker is repeated
    only when ``repeatable`` (a force release is not: its repeat could end the next holder's
    lease)."""

    def __init__(self, context: str, timeout: float, repeatable: bool = True):
        self.context = context
        self.timeout = timeout
        self._repeatable = repeatable
        self._give_up = time.monotonic() + timeout
        self._backoff = Backoff()

    def request_timeout(self) -> float:
        return max(self._give_up - time.monotonic(), 0.05)

    def no_answer(self, e: NoAnswer) -> float:
        if e.sent and not self._repeatable:
            raise Unavailable(f"{self.context}: {e} (it may or may not have been done)",
                              code="unreachable")
        return self._pause(None, str(e))

    def retry(self, answer: Answer) -> float:
        """The pause before repeating an answer that was not the call's own; raises for one that
        ends the call."""
        if answer.status not in RETRYABLE:
            raise error_from(answer, self.context)
        return self._pause(answer, f"HTTP {answer.status}: {answer.message}")

    def _pause(self, answer: Optional[Answer], problem: str) -> float:
        now = time.monotonic()
        if now >= self._give_up:
            raise Unavailable(f"{self.context}: {problem}",
                              status=answer.status if answer is not None else None,
                              code=answer.code if answer is not None else "unreachable")
        return min(self._backoff.delay(answer.retry_after() if answer else None),
                   self._give_up - now)


def inspect_request(url: str, key: str, semaphore: bool) -> Tuple[str, str]:
    space = "semaphores" if semaphore else "locks"
    return key_path(space, key), where("inspect of", key, url)


def inspect_view(key: str, answer: Answer, semaphore: bool) -> Optional[KeyView]:
    """The view an inspect answered, or ``None`` for an answer to retry or raise."""
    if answer.status == 200:
        return KeyView(key, answer.body, held=True, semaphore=semaphore)
    if answer.status == 404 and answer.code == "not_held":
        return KeyView(key, answer.body, held=False, semaphore=semaphore)
    return None


def list_request(url: str, prefix: str, limit: int, cursor: Optional[str]) -> Tuple[str, str]:
    if not isinstance(prefix, str):
        raise TypeError(f"prefix is a str, not {type(prefix).__name__}")
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= 1000:
        raise ValueError(f"limit is an int from 1 to 1000; got {limit!r}")
    query = {"prefix": prefix, "limit": str(limit)}
    if cursor is not None:
        query["cursor"] = cursor
    return f"/locks?{urllib.parse.urlencode(query)}", f"list of {prefix!r}* at {url}"


def list_page(answer: Answer) -> Optional[Page]:
    if answer.status != 200:
        return None
    locks = [KeyView(entry["key"], entry, held=True, semaphore=False)
             for entry in answer.body.get("locks") or []
             if isinstance(entry, dict) and isinstance(entry.get("key"), str)]
    cursor = answer.body.get("next_cursor")
    return Page(locks, cursor if isinstance(cursor, str) else None)


def force_request(url: str, key: str, semaphore: bool) -> Tuple[str, str]:
    space = "semaphores" if semaphore else "locks"
    return key_path(space, key) + "?force=true", where("force release of", key, url)


def forced(answer: Answer) -> Optional[bool]:
    """``True`` when a force release ended leases, ``False`` when there were none."""
    if answer.status == 204:
        return True
    if answer.status == 404 and answer.code == "not_held":
        return False
    return None
