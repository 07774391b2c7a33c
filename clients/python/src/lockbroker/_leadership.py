"""Leader election on one lock key: :class:`Leadership` campaigns in the background (a waiting
acquire, again and again), keeps the won lease renewed, tells the application when it is elected
and when it stops leading, and follows the key with a watch so that every node knows who leads.

One thread campaigns and runs the callbacks, so they never overlap and a revocation is always
reported before the next campaign can begin: from one instance's view there are never two
terms at once.
"""

import logging
import threading
from typing import TYPE_CHECKING, Any, Callable, List, Optional

from ._calls import inspect_request, inspect_view
from ._errors import BrokerError, Locked, Unavailable, error_from
from ._lease import Lease
from ._lease_state import Backoff, _takes_an_argument, ttl_ms
from ._transport import RETRYABLE, Answer, ClosedOnExit, NoAnswer
from ._watch import KeyView

if TYPE_CHECKING:
    from ._broker import Broker

log = logging.getLogger("lockbroker")


class Leadership(ClosedOnExit):
    """Campaigns for the lock ``key`` as ``name`` (the lease's ``owner`` label) with leases of
    ``ttl`` seconds, from construction until :meth:`close`.

    - :meth:`is_leader`: whether this node leads now (its lease provably held, not closing).
    - :meth:`leader`: the leader's ``name`` as the key's watch last showed it (``None``: nobody).
    - :meth:`on_elected` / :meth:`on_revoked`: callbacks (no argument, or the :class:`Lease` of
      the term) run on the campaign thread when this node becomes leader, and once when it stops:
      its lease lost (then it campaigns again) or :meth:`close`. ``on_revoked`` returns before the
      lease is released on close, so the successor starts after the old leader stopped.
    - :meth:`close` (or :meth:`resign`): stops campaigning and, when leading, runs the revocation
      and releases the lease, so that the next candidate is granted at once.

    Each campaign waits in parts of ``part`` seconds; a candidate closed while it waits leaves
    the broker's queue when that part ends (a grant that comes then is released at once).

    A refusal is not campaigned through: the constructor looks at the key first and raises the
    :class:`BrokerError` of a bad token (``401``) or a token without rights to the key
    (``403``); one that comes later (a token revoked, or allowed to read but not to lock) stops
    the campaign, logged once as an error, and :attr:`error` gives it.
    """

    def __init__(self, client: "Broker", key: str, name: str, ttl: float = 10.0, *,
                 part: float = 5.0):
        check_campaign(ttl, part, name)
        self.key = key
        self.name = name
        self.ttl = float(ttl)
        self._client = client
        self._part = float(part)
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._closed = False
        self._lease: Optional[Lease] = None
        self._view: Optional[KeyView] = None
        self._elected: List[Callable[..., Any]] = []
        self._revoked: List[Callable[..., Any]] = []
        self._error: Optional[BrokerError] = None
        _first_look(client, key)
        self._follower = client.follow(key, part=self._part)
        self._campaigner = threading.Thread(target=self._campaign, daemon=True,
                                            name=f"lockbroker-campaign-{key}")
        self._watcher = threading.Thread(target=self._watch, daemon=True,
                                         name=f"lockbroker-leader-watch-{key}")
        self._campaigner.start()
        self._watcher.start()

    # -- what the application sees --------------------------------------------------------------

    def is_leader(self) -> bool:
        with self._lock:
            lease = None if self._closed else self._lease
        return lease is not None and lease.held

    def leader(self) -> Optional[str]:
        """The current leader's name: this node's while it leads, else the owner the key's watch
        last showed (``None`` when the key is free or its holder gave no owner)."""
        if self.is_leader():
            return self.name
        with self._lock:
            view = self._view
        return view.owner if view is not None else None

    @property
    def lease(self) -> Optional[Lease]:
        """The lease of the current term while this node leads (its ``fence`` names the term:
        pass it to what the leader writes), else ``None``."""
        with self._lock:
            return self._lease

    @property
    def error(self) -> Optional[BrokerError]:
        """The refusal that stopped the campaign (``401``/``403``...), or ``None``."""
        with self._lock:
            return self._error

    def on_elected(self, callback: Callable[..., Any]) -> None:
        """Runs ``callback`` each time this node becomes leader (with the term's lease if it
        takes an argument). Registered while leading, it runs at once for this term."""
        if not callable(callback):
            raise TypeError("on_elected takes a callable")
        with self._lock:
            self._elected.append(callback)
            lease = self._lease
        if lease is not None and lease.held:
            _call(callback, lease, "on_elected")

    def on_revoked(self, callback: Callable[..., Any]) -> None:
        """Runs ``callback`` once per term when this node stops leading (lease lost, or close)."""
        if not callable(callback):
            raise TypeError("on_revoked takes a callable")
        with self._lock:
            self._revoked.append(callback)

    def close(self) -> None:
        """Stops campaigning; when leading, runs the ``on_revoked`` callbacks and then releases
        the lease, and returns after that. Idempotent."""
        with self._cond:
            self._closed = True
            leading = self._lease is not None
            self._cond.notify_all()
        self._follower.close()
        if leading and threading.current_thread() is not self._campaigner:
            # The campaign thread revokes and releases; waiting for it makes close() mean "no
            # longer leading". Bounded: a release gives up after the client's timeout.
            self._campaigner.join()

    def resign(self) -> None:
        """The same as :meth:`close`."""
        self.close()

    def __repr__(self) -> str:
        return f"<Leadership key={self.key!r} name={self.name!r} leader={self.is_leader()}>"

    # -- the campaign thread --------------------------------------------------------------------

    def _campaign(self) -> None:
        backoff = Backoff()
        while True:
            with self._lock:
                if self._closed:
                    return
            try:
                lease = self._client.acquire(self.key, self.ttl, self._part, owner=self.name)
            except Locked:
                backoff.reset()
                continue
            except Unavailable as e:
                if self._client._core.closed:
                    return
                # Campaigning goes on, as a node must not give up leading for a passing outage.
                log.debug("campaign for %r: %s", self.key, e)
                with self._cond:
                    if not self._closed:
                        self._cond.wait(backoff.delay())
                continue
            except BrokerError as e:
                if not self._client._core.closed:
                    # A refusal (401/403): asking again would only be refused again.
                    log.error("campaign for %r stopped: %s", self.key, e)
                    with self._lock:
                        self._error = e
                return
            backoff.reset()
            with self._lock:
                stale = self._closed
                if not stale:
                    self._lease = lease
                elected = list(self._elected)
            if stale:
                _release(lease)
                return
            lease.on_lost(self._wake)
            log.info("%s leads %r (fence %d)", self.name, self.key, lease.fence)
            for callback in elected:
                _call(callback, lease, "on_elected")
            with self._cond:
                # on_lost wakes this at once. The timeout is for a lease that ends without
                # being lost: released by the Broker's close(), which runs no callback.
                while not self._closed and lease.held:
                    self._cond.wait(1.0)
                closing = self._closed
                revoked = list(self._revoked)
            for callback in revoked:
                _call(callback, lease, "on_revoked")
            # Only now is the term over for this instance: is_leader() said False already if the
            # lease was lost; on close it says so from here, and the release lets the next
            # candidate in.
            with self._lock:
                self._lease = None
            if closing:
                _release(lease)
                return
            log.info("%s no longer leads %r: %s", self.name, self.key, lease.lost_reason)

    def _wake(self) -> None:
        with self._cond:
            self._cond.notify_all()

    # -- the watch thread -----------------------------------------------------------------------

    def _watch(self) -> None:
        backoff = Backoff()
        while not self._follower.closed:
            try:
                for view in self._follower:
                    with self._lock:
                        self._view = view
                    backoff.reset()
                return
            except BrokerError as e:
                if self._follower.closed or self._client._core.closed:
                    return
                log.debug("watch of %r for its leader: %s", self.key, e)
                with self._cond:
                    if not self._closed:
                        self._cond.wait(backoff.delay())


def _first_look(client: "Broker", key: str) -> None:
    """One inspect of ``key``: raises for a bad key (``ValueError``) and for a refusal (a wrong
    token: 401; no rights to the key: 403). No answer, or a 503, is the campaign's business:
    it is not waited out here."""
    path, context = inspect_request(client.url, key, False)
    try:
        answer = client._core.transport.request("GET", path, timeout=client._core.timeout)
    except NoAnswer:
        return
    check_look(key, answer, context)


def check_campaign(ttl: float, part: float, name: str) -> None:
    """The checks of a candidate's settings (both clients' election helpers)."""
    ttl_ms(ttl)
    ttl_ms(part, "part")
    if not isinstance(name, str) or not name:
        raise ValueError("name is a non-empty str (the leader's owner label)")


def check_look(key: str, answer: Answer, context: str) -> None:
    """Raises the refusal a first look at ``key`` was answered with (401, 403...); a view, or
    a 503, is fine."""
    if inspect_view(key, answer, False) is None and answer.status not in RETRYABLE:
        raise error_from(answer, context)


def _release(lease: Lease) -> None:
    try:
        lease.release()
    except BrokerError as e:
        log.warning("could not release the leadership lease on %r (fence %d): %s",
                    lease.key, lease.fence, e)


def _call(callback: Callable[..., Any], lease: Lease, what: str) -> None:
    try:
        if _takes_an_argument(callback):
            callback(lease)
        else:
            callback()
    except Exception:
        log.exception("a %s callback of the leadership of %r raised", what, lease.key)
