"""Several keys at once (api.md, "Several keys at once"): one ``POST /locks`` with
``{"keys": [...]}`` takes every key or none, with one token and a fence per key.

What it grants is an ordinary lease (sync or asyncio, under a session or not) with the
:class:`SeveralKeys` mixin: ``key``/``fence`` are the first key's, ``keys`` and ``fences`` (a
dict key → fence) all of them; its renewal renews every key with the one token (a lease under a
session is kept by the session instead); its release releases them all
(``DELETE /locks?keys=...``); and when any key is lost the whole lease is lost and the keys
still held are released.
"""

import asyncio
import time
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

from ._calls import AcquireRun
from ._errors import BrokerError, where
from ._lease_state import NOT_HELD, NOT_OWNER, check_key, key_path
from ._transport import RETRYABLE, Answer

#: The broker's most keys in one request.
MAX_KEYS = 64


def check_keys(keys: Iterable[str]) -> List[str]:
    """``keys`` as a list if the broker would take them (1 to 64 distinct keys, each by the key
    rule), else ``TypeError``/``ValueError`` saying why."""
    if isinstance(keys, (str, bytes)):
        raise TypeError("keys is a list of keys, not one str")
    keys = [check_key(key) for key in keys]
    if not 1 <= len(keys) <= MAX_KEYS:
        raise ValueError(f"acquire_all takes 1 to {MAX_KEYS} keys; got {len(keys)}")
    seen = set()
    for key in keys:
        if key in seen:
            raise ValueError(f"acquire_all takes distinct keys; {key!r} is given twice")
        seen.add(key)
    return keys


class AcquireAllRun(AcquireRun):
    """The attempts of one acquire of several keys: as an :class:`AcquireRun` (one
    ``request_id`` for every retry, so a repeat answers the same leases), to ``POST /locks``."""

    def __init__(self, url: str, keys: Iterable[str], ttl: float, wait: float, shared: bool,
                 owner: Optional[str], renew_every: Optional[float], auto_renew: bool,
                 on_trouble: Any, max_wait: float, timeout: float,
                 session: Optional[str] = None):
        checked = check_keys(keys)
        params: Dict[str, Any] = {"mode": "shared"} if shared else {}
        super().__init__(url, "locks", checked, ttl, wait, params,  # type: ignore[arg-type]
                         "shared" if shared else "exclusive", owner, renew_every, auto_renew,
                         on_trouble, max_wait, timeout, session)
        self.keys = checked
        self.key = checked[0]
        self._lease_args["key"] = checked[0]
        self.body["keys"] = checked

    def _target(self, url: str, space: str, key: Any) -> Tuple[str, str]:
        return "/locks", where("acquire of", ",".join(key), url)

    def args(self, body: Dict[str, Any], sent_at: Optional[float] = None) -> Dict[str, Any]:
        """The arguments of the lease a ``201`` answered: a fence for every key asked for."""
        fences: Dict[str, int] = {}
        for entry in body.get("leases") or []:
            if isinstance(entry, dict) and isinstance(entry.get("key"), str) and \
                    isinstance(entry.get("fence"), int):
                fences[entry["key"]] = entry["fence"]
        if not isinstance(body.get("token"), str) or set(fences) != set(self.keys):
            raise BrokerError(f"{self.context}: the broker's grant has no token or not a fence "
                              "for every key", status=201, code="bad_response")
        return dict(self._lease_args, body=dict(body, fence=fences[self.key]),
                    sent_at=self._sent_at(sent_at),
                    fences={key: fences[key] for key in self.keys})


def acquire_all_run(client: Any, keys: Iterable[str], ttl: float, wait: float, shared: bool,
                    owner: Optional[str], auto_renew: bool, renew_every: Optional[float],
                    on_trouble: Optional[Callable[[Optional[str]], Any]]) -> AcquireAllRun:
    """The run of ``client.acquire_all`` (a Broker or an AsyncBroker), with its defaults."""
    return AcquireAllRun(client.url, keys, ttl, wait, shared,
                         owner if owner is not None else client._owner, renew_every, auto_renew,
                         on_trouble if on_trouble is not None else client._on_trouble,
                         client._max_wait, client._core.timeout)


def session_run(session: Any, keys: Iterable[str], wait: float, shared: bool,
                owner: Optional[str]) -> AcquireAllRun:
    """The run of ``session.acquire_all`` (raises when the session is closed or lost)."""
    session._check_usable()
    client = session._client
    return AcquireAllRun(client.url, keys, session.ttl, wait, shared, owner, None, False, None,
                         client._max_wait, session._core.timeout, session=session._id)


class SeveralKeys:
    """What a several-keys lease does differently from a one-key one (mixed in before the lease
    class; the lease's constructor takes ``fences`` besides)."""

    _core: Any
    _lost_reason: Optional[str]

    def __init__(self, *args: Any, fences: Dict[str, int], **kwargs: Any):
        #: Every key of the lease, in the order asked for, and its fence.
        self.fences: Dict[str, int] = dict(fences)
        self.keys: List[str] = list(self.fences)
        super().__init__(*args, **kwargs)  # type: ignore[call-arg]

    def __repr__(self) -> str:
        return super().__repr__().replace(" fence=", f" keys={self.keys!r} fence=", 1)

    def _renew_paths(self) -> List[str]:
        return [key_path("locks", key) + "/renew" for key in self.keys]

    def _release_path(self) -> str:
        # Keys are of A-Z a-z 0-9 . _ - : (the key rule): nothing to escape in a query.
        return "/locks?keys=" + ",".join(self.keys)

    def _release_answer(self, answer: Optional[Answer]) -> Optional[Answer]:
        """``DELETE /locks?keys=`` answers ``200`` with a status per key: as one answer, ``204``
        when every key is gone (``204``/``404``/``409``), else the first other key's status
        (a ``503`` first: that release is tried again)."""
        if answer is None or answer.status != 200:
            return answer
        results = answer.body.get("results")
        statuses = {entry.get("key"): entry.get("status") for entry in results or []
                    if isinstance(entry, dict)} if isinstance(results, list) else {}
        if set(statuses) != set(self.keys):
            return Answer(502, answer.headers, {
                "error": "bad_response",
                "message": "the broker's answer to the release has no result for every key"})
        others = [(key, status) for key, status in statuses.items()
                  if status not in (204, 404, 409)]
        if not others:
            return Answer(204, answer.headers, {})
        others.sort(key=lambda pair: pair[1] not in RETRYABLE)
        key, status = others[0]
        status = status if isinstance(status, int) else 502
        return Answer(status, answer.headers, {
            "error": "unavailable" if status in RETRYABLE else "refused",
            "message": f"the release of {key!r} was answered HTTP {status}"})

    def _lose(self, reason: str, problem: Optional[str]) -> None:
        """Loses the whole lease (its callbacks run), then releases the keys it still holds
        when one key was found gone (not when its end passed, or its session's did: then every
        key ends by itself)."""
        super()._lose(reason, problem)  # type: ignore[misc]
        if reason not in (NOT_HELD, NOT_OWNER):
            return
        session = getattr(self, "_session", None)
        if session is not None and not session._alive_at(time.monotonic()):
            return
        pending = self._drop()  # type: ignore[attr-defined]
        if pending is not None:  # the asyncio client's: a task, which close waits for
            task = asyncio.ensure_future(pending)
            self._core.cleanups.add(task)
            task.add_done_callback(self._core.cleanups.discard)
