"""Watching a key: what one watch answers (:class:`KeyView`), the call itself, and
:class:`Follower`, which watches again with each answer's fence so that the caller sees every
change, once and in order.

A watch is one ``GET /locks/{key}?watch=F&wait_ms=W`` (or ``/semaphores/...``): the broker
answers at once when the key's holders differ from fence ``F`` (``0`` for "free"), else when
they change, else with ``changed: false`` when the wait runs out. A watch never shows a token.
"""

import logging
import threading
import time
from typing import TYPE_CHECKING, Any, Dict, Iterator, List, NamedTuple, Optional, Tuple

from ._errors import BrokerError, Unavailable, error_from, where
from ._lease_state import Backoff, key_path
from ._transport import RETRYABLE, Answer, ClosedOnExit

if TYPE_CHECKING:
    from ._broker import _Core

log = logging.getLogger("lockbroker")


class Holder(NamedTuple):
    """One holder of a shared lock or one permit of a semaphore: its ``fence``, ``owner`` label
    (or ``None``) and ``expires_at`` (Unix seconds on the broker's store clock, or ``None``)."""

    fence: int
    owner: Optional[str]
    expires_at: Optional[float]


class KeyView:
    """A key as a watch saw it. Never a token.

    - ``key``; ``changed``: whether it differs from the fence the watch was given (``False``
      when the wait ran out with nothing changed).
    - ``fence``: the holder's fence (for shared holders or a semaphore, the highest), or
      ``None`` when the key is free; ``held`` says the same as a bool.
    - ``owner``: the exclusive holder's label (``None`` for none, for shared holders and for
      semaphores: each holder's is in ``holders``).
    - ``mode``: ``"exclusive"``, ``"shared"``, ``"permit"`` (a semaphore) or ``None`` (free).
    - ``expires_at``: when the lease that ends last ends, in Unix seconds on the broker's store
      clock (``None`` when free); ``holders``: the shared holders or permits, as :class:`Holder`
      (empty for an exclusive holder); ``limit``: a semaphore's, else ``None``.
    - ``next_fence``: the fence to watch with next (``fence``, or ``0`` when free).
    """

    __slots__ = ("key", "changed", "fence", "owner", "mode", "expires_at", "holders", "limit")

    def __init__(self, key: str, body: Dict[str, Any], *, held: bool, semaphore: bool):
        self.key = key
        self.changed = body.get("changed") is True
        fence = body.get("fence") if held else None
        self.fence: Optional[int] = fence if isinstance(fence, int) else None
        owner = body.get("owner") if held else None
        self.owner: Optional[str] = owner if isinstance(owner, str) else None
        mode = body.get("mode")
        if not held:
            self.mode: Optional[str] = None
        elif semaphore:
            self.mode = "permit"
        else:
            self.mode = mode if isinstance(mode, str) else "exclusive"
        self.expires_at = _seconds(body.get("expires_at_ms")) if held else None
        holders: List[Holder] = []
        for entry in (body.get("holders") or []) if held else []:
            if isinstance(entry, dict) and isinstance(entry.get("fence"), int):
                entry_owner = entry.get("owner")
                holders.append(Holder(entry["fence"],
                                      entry_owner if isinstance(entry_owner, str) else None,
                                      _seconds(entry.get("expires_at_ms"))))
        self.holders = tuple(holders)
        if self.fence is None and holders:
            self.fence = max(h.fence for h in holders)
        if self.expires_at is None and holders:
            ends = [h.expires_at for h in holders if h.expires_at is not None]
            self.expires_at = max(ends) if ends else None
        limit = body.get("limit") if held else None
        self.limit: Optional[int] = limit if isinstance(limit, int) else None

    @property
    def held(self) -> bool:
        return self.fence is not None

    @property
    def next_fence(self) -> int:
        return self.fence if self.fence is not None else 0

    def __repr__(self) -> str:
        if not self.held:
            state = "free"
        else:
            state = f"fence={self.fence} mode={self.mode!r} owner={self.owner!r}"
            if self.holders:
                state += f" holders={len(self.holders)}"
        return f"<KeyView key={self.key!r} {state} changed={self.changed}>"


def _seconds(ms: Any) -> Optional[float]:
    return ms / 1000.0 if isinstance(ms, int) and not isinstance(ms, bool) else None


def check_fence(seen_fence: Any) -> int:
    if isinstance(seen_fence, bool) or not isinstance(seen_fence, int) or seen_fence < 0:
        raise ValueError(f"seen_fence is an int >= 0 (0 for free); got {seen_fence!r}")
    return seen_fence


def check_wait(wait: Any) -> float:
    if isinstance(wait, bool) or not isinstance(wait, (int, float)) or not wait >= 0 \
            or wait == float("inf"):
        raise ValueError(f"wait must be a number of seconds >= 0; got {wait!r}")
    return float(wait)


class WatchRun:
    """The decisions of one watch (sync or async): asked in parts of at most ``max_wait`` while
    nothing changes, ``503``s and lost answers retried while the wait lasts (a watch changes
    nothing, so a repeat is harmless)."""

    def __init__(self, url: str, max_wait: float, timeout: float, space: str, key: str,
                 seen_fence: int, wait: float):
        self._path = key_path(space, key)
        self._key = key
        self._seen = check_fence(seen_fence)
        self._semaphore = space == "semaphores"
        self._context = where("watch of", key, url)
        self._max_wait = max_wait
        self._timeout = timeout
        self._deadline = time.monotonic() + check_wait(wait)
        self._backoff = Backoff()

    def request(self) -> Tuple[str, float]:
        """The next attempt's target and timeout."""
        ask = min(max(self._deadline - time.monotonic(), 0.0), self._max_wait)
        return f"{self._path}?watch={self._seen}&wait_ms={int(ask * 1000)}", ask + self._timeout

    def answered(self, answer: Optional[Answer], problem: str) -> Tuple[Optional[KeyView], float]:
        """(the view to return, or ``None`` and the pause before asking again). Raises for a
        refusal, and :class:`Unavailable` when the wait ran out without an answer."""
        if answer is not None:
            held = answer.status == 200
            if held or (answer.status == 404 and answer.code == "not_held"):
                view = KeyView(self._key, answer.body, held=held, semaphore=self._semaphore)
                if not view.changed and time.monotonic() < self._deadline - 0.001:
                    return None, 0.0  # a wait longer than the broker's longest, asked in parts
                return view, 0.0
            if answer.status not in RETRYABLE:
                raise error_from(answer, self._context)
            problem = answer.message
        delay = self._backoff.delay(answer.retry_after() if answer is not None else None)
        now = time.monotonic()
        if now >= self._deadline:
            raise Unavailable(
                f"{self._context}: {problem}",
                status=answer.status if answer is not None else None,
                code=answer.code if answer is not None else "unreachable",
            )
        log.debug("watch of %r not answered: %s; again in %.2f s", self._key, problem,
                  min(delay, self._deadline - now))
        return None, min(delay, self._deadline - now)


def watch_once(core: "_Core", max_wait: float, space: str, key: str, seen_fence: int,
               wait: float) -> KeyView:
    """The watch behind ``Broker.watch`` (see :class:`WatchRun`)."""
    run = WatchRun(core.url, max_wait, core.timeout, space, key, seen_fence, wait)
    while True:
        if core.closed:
            raise BrokerError("this Broker is closed", code="closed")
        target, timeout = run.request()
        answer, problem = core.transport.attempt("GET", target, timeout=timeout)
        view, pause = run.answered(answer, problem)
        if view is not None:
            return view
        if pause:
            time.sleep(pause)


class Follower(ClosedOnExit):
    """Every change of one key, in order: iterate it for :class:`KeyView` s (each with
    ``changed`` true). Made by ``Broker.follow``.

    Each watch is asked with the fence of the last view (``0`` after a free one), so a change is
    never reported twice, and changes between two watches show as one (the key as it is then).
    ``close()`` (from any thread) ends the iteration; a watch under way ends first, within
    ``part`` seconds. The iteration raises :class:`Unavailable` when the broker could not be
    reached for a whole ``part``; ``follow`` again with ``seen_fence=follower.fence`` to go on.
    """

    def __init__(self, core: "_Core", max_wait: float, space: str, key: str, seen_fence: int,
                 part: float):
        self.key = key
        self.fence = check_fence(seen_fence)
        if not check_wait(part) > 0:
            raise ValueError("part must be a positive number of seconds")
        self._core = core
        self._max_wait = max_wait
        self._space = space
        self._part = part
        self._closed = threading.Event()

    def __iter__(self) -> Iterator[KeyView]:
        while not self._closed.is_set():
            view = watch_once(self._core, self._max_wait, self._space, self.key, self.fence,
                              self._part)
            if self._closed.is_set():
                return
            if view.changed:
                self.fence = view.next_fence
                yield view

    def close(self) -> None:
        self._closed.set()

    @property
    def closed(self) -> bool:
        return self._closed.is_set()

    def __repr__(self) -> str:
        return f"<Follower key={self.key!r} fence={self.fence}>"
