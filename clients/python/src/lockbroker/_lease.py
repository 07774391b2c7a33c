"""A sync lease (:class:`Lease`): its renewal, its lost signal and its release, on top of the
:class:`~lockbroker._lease_state.LeaseState` it shares with the asyncio client; and the one
thread that renews every lease and keeps every session of a sync :class:`~lockbroker.Broker`
(:class:`Renewer`), and what they share with it (:class:`_Core`).
"""

import heapq
import itertools
import logging
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Set, Tuple

from ._errors import BrokerError
from ._lease_state import (_GONE, _RENEWED, _STOPPED, _WAIT, EXPIRED, LeaseState,
                           _takes_an_argument, earlier, ttl_ms)
from ._several import SeveralKeys
from ._transport import Answer

if TYPE_CHECKING:
    from ._transport import Transport

log = logging.getLogger("lockbroker")


class Lease(LeaseState):
    """One lease: an exclusive or shared lock, or a semaphore permit.

    Attributes: ``key``, ``fence`` (int, strictly greater than every fence granted before for
    the key: pass it to the resource you write), ``mode`` (``"exclusive"``, ``"shared"`` or
    ``"permit"``), ``limit`` (the semaphore's, or ``None``), ``ttl`` (seconds), ``expires_at``
    (Unix time in seconds on the broker's store clock, as last granted or renewed).

    The token that proves ownership stays inside: it is never in ``repr``, a log line or an
    error. Whoever has this object may renew and release it, from any thread. Its renewals run
    on its :class:`~lockbroker.Broker`'s one renewal thread, with every other lease's.
    """

    def __init__(self, core: Any, **kwargs: Any):
        super().__init__(core, **kwargs)
        self._cond = threading.Condition(self._lock)
        self._in_flight = 0
        #: When the renewal thread will look at this lease next (its business, under its lock).
        self._scheduled: Optional[float] = None

    def on_lost(self, callback: Callable[..., Any]) -> None:
        """Registers ``callback`` to run once when the lease is lost, on the client's renewal
        thread (keep it quick: hand long work to a thread of your own). It is called with the
        lease if it takes an argument, else with none. A callback registered after the loss
        runs at once, in this call. A released lease is not lost: its callbacks never run."""
        if not self._add_callback(callback):
            self._run_callback(callback)

    def renew(self, ttl: Optional[float] = None) -> bool:
        """Renews the lease now (the auto-renewal does this by itself; this is for leases taken
        with ``auto_renew=False``), for ``ttl`` seconds or the lease's own ttl. Returns ``True``
        when renewed, ``False`` when the lease is lost (then the lost callbacks run). Raises
        :class:`Unavailable` when the broker did not confirm, :class:`BrokerError` when the
        lease was released."""
        if self._renew_args(ttl) is False:
            return False
        outcome, answer, problem = self._renew_once(time.monotonic())
        if outcome == _RENEWED:
            self._core.renewer.schedule(self, self._next_due())
        return self._renew_result(outcome, answer, problem)

    def release(self) -> None:
        """Ends the lease: stops its renewals for good (waiting for one under way), then
        ``DELETE``s it, retrying ``503``s and network errors for up to the broker's ``timeout``.
        Idempotent; quiet when the broker says the lease had already ended (``404``/``409``) or
        when its end has passed. Raises :class:`Unavailable` when the lease may still stand and
        the broker could not be reached to end it (it then ends by its ttl, as it is no longer
        renewed), :class:`BrokerError` for a refusal such as ``403``."""
        self._release(time.monotonic() + self._core.timeout)

    def _release(self, give_up: float) -> None:
        with self._cond:
            if self._release_done:
                return
            self._released = True
            while self._in_flight:
                self._cond.wait()
        while True:
            answer, problem = self._core.transport.attempt(
                "DELETE", self._release_path(), headers={"Lock-Token": self._token},
                timeout=max(give_up - time.monotonic(), 0.05))
            done, pause = self._deleted(self._release_answer(answer), problem, give_up)
            if done:
                break
            time.sleep(pause)
        self._release_finished()

    def close(self) -> None:
        """The same as :meth:`release`."""
        self.release()

    def __enter__(self) -> "Lease":
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        try:
            self.release()
        except BrokerError as e:
            self._release_failed_on_exit(exc_type, e)

    # -- renewal, on the Broker's renewal thread ----------------------------------------------

    def _start(self) -> None:
        self._core.renewer.schedule(self, self._next_due())

    def _step(self) -> Optional[float]:
        return step(self)

    def _renew_once(self, now: float, confirming: bool = False) -> Tuple[str, Optional[Answer], str]:
        """One renewal request, sent at ``now``. Returns (outcome, answer or None, problem)."""
        with self._lock:
            begun = self._begin_renewal(now, confirming)
            if begun is None:
                return _STOPPED, None, "released"
            self._in_flight += 1
        ttl, timeout = begun
        if not confirming:
            # One thread renews every lease of the Broker: this request gives up in time for
            # the others (at least half a second, or the lease's own bound if shorter).
            timeout = min(timeout, max(self._core.horizon(self) - now, 0.5))
        try:
            answer, problem = self._send_renewal({"ttl_ms": ttl_ms(ttl)}, timeout)
        finally:
            with self._cond:
                self._in_flight -= 1
                self._cond.notify_all()
        outcome, reason, problem = self._settle(now, ttl, answer, problem, confirming)
        if reason is not None:
            self._lose(reason, problem)
        return outcome, answer, problem

    def _send_renewal(self, body: Optional[Dict[str, Any]], timeout: float
                      ) -> Tuple[Optional[Answer], str]:
        """Renews every key of the lease within ``timeout``: the first answer that is not a
        ``200`` (or ``None`` and why no answer came), else the ``200`` that ends first."""
        give_up = time.monotonic() + timeout
        kept: Optional[Answer] = None
        for path in self._renew_paths():
            answer, problem = self._core.transport.attempt(
                "POST", path, body=body, headers={"Lock-Token": self._token},
                timeout=max(give_up - time.monotonic(), 0.05))
            if answer is None or answer.status != 200:
                return answer, problem
            kept = earlier(kept, answer)
        return kept, ""

    def _confirm(self) -> str:
        """The renewal that fixes the end of a lease granted after a wait (see
        ``Broker._grant``): its outcome."""
        return self._renew_once(time.monotonic(), confirming=True)[0]

    def _drop(self) -> None:
        """Ends a lease that is not handed out, quietly."""
        try:
            self.release()
        except BrokerError as e:
            log.warning("could not release the lease on %r (fence %d): %s",
                        self.key, self.fence, e)

    def _lose(self, reason: str, problem: Optional[str]) -> None:
        callbacks = self._mark_lost(reason, problem)
        for callback in callbacks or ():
            self._run_callback(callback)

    def _run_callback(self, callback: Callable[..., Any]) -> None:
        call_back(callback, self, f"an on_lost callback of the lease on {self.key!r}")

    def _report_trouble(self, trouble: Optional[str]) -> None:
        if self._on_trouble is None:
            return
        try:
            self._on_trouble(trouble)
        except Exception:
            log.exception("the on_trouble hook of the lease on %r raised", self.key)


def call_back(callback: Callable[..., Any], subject: Any, what: str) -> None:
    """Runs a lost callback with ``subject`` (a lease or a session) if it takes an argument,
    else with none; logs what it raises."""
    try:
        if _takes_an_argument(callback):
            callback(subject)
        else:
            callback()
    except Exception:
        log.exception("%s raised", what)


def step(kept: Any) -> Optional[float]:
    """One look by the renewal thread at a lease or a session (``kept``): renews it when due
    (its ``_renew_once``), loses it when its end came. Returns when to look next, or ``None``
    for never."""
    now = time.monotonic()
    action, when = kept._next_step(now)
    if action == _STOPPED:
        return None
    if action == EXPIRED:
        kept._lose(EXPIRED, None)
        return None
    if action == _WAIT:
        return when
    outcome, answer, problem = kept._renew_once(now)
    if outcome == _RENEWED:
        if kept._recovered():
            kept._report_trouble(None)
        return kept._next_due()
    if outcome in (_GONE, _STOPPED):
        return None
    trouble = kept._failed(answer, problem)
    if trouble is not None:
        kept._report_trouble(trouble)
    return kept._next_due()


class _Core:
    """What a broker's leases and sessions share with it: the transport, the settings, the open
    leases and sessions, and the thread that renews them all."""

    def __init__(self, transport: "Transport", timeout: float, renew_fraction: float):
        self.transport = transport
        self.url = transport.url
        self.timeout = timeout
        self.renew_fraction = renew_fraction
        self.lock = threading.Lock()
        self.leases: Set[Lease] = set()
        self.sessions: Set[Any] = set()
        self.renewer = Renewer()
        self.closed = False

    def forget(self, lease: Lease) -> None:
        with self.lock:
            self.leases.discard(lease)

    def forget_session(self, session: Any) -> None:
        with self.lock:
            self.sessions.discard(session)

    def horizon(self, renewing: Any) -> float:
        """The earliest end among the other live leases and sessions: a renewal on the one
        renewal thread must not keep them from theirs (a request stuck on a dead connection)
        past it."""
        with self.lock:
            others = [other for other in self.leases if other is not renewing]
            sessions = [other for other in self.sessions if other is not renewing]
        ends = [other._end for other in others
                if not other._released and other._lost_reason is None]
        ends += [other._end for other in sessions if other.alive]
        return min(ends, default=float("inf"))


class Renewer:
    """The one thread that renews every lease of one :class:`~lockbroker.Broker` and keeps its
    sessions alive: a heap of the instants at which a lease (or a session: anything with
    ``_scheduled`` and ``_step``) needs a look (a renewal due, or its end), and a condition
    variable to sleep on until the first. Started with the first lease or session, stopped by
    ``close``."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._heap: List[Tuple[float, int, Lease]] = []
        self._seq = itertools.count()
        self._thread: Optional[threading.Thread] = None
        self._stopped = False

    def schedule(self, lease: Lease, due: float) -> None:
        """Makes the thread look at ``lease`` at ``due`` (or earlier, if that was set)."""
        with self._cond:
            if self._stopped:
                return
            if lease._scheduled is not None and lease._scheduled <= due:
                return
            lease._scheduled = due
            heapq.heappush(self._heap, (due, next(self._seq), lease))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="lockbroker-renewer",
                                                daemon=True)
                self._thread.start()
            self._cond.notify()

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._heap = []
            self._cond.notify()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    def _run(self) -> None:
        while True:
            with self._cond:
                while True:
                    if self._stopped:
                        return
                    if not self._heap:
                        self._cond.wait()
                        continue
                    due, _, lease = self._heap[0]
                    if lease._scheduled != due:
                        heapq.heappop(self._heap)  # superseded by an earlier look
                        continue
                    now = time.monotonic()
                    if due > now:
                        self._cond.wait(due - now)
                        continue
                    heapq.heappop(self._heap)
                    lease._scheduled = None
                    break
            try:
                following = lease._step()
            except Exception:
                log.exception("the renewal of %r failed", lease)
                following = None
            if following is not None:
                self.schedule(lease, following)


class SeveralLease(SeveralKeys, Lease):
    """The lease of :meth:`~lockbroker.Broker.acquire_all`: a :class:`Lease` on several keys
    (``keys``, ``fences``; ``key``/``fence`` the first key's), each renewed with the one token,
    released together, lost together."""
