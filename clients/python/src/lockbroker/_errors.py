"""The errors the client raises: one base class, :class:`BrokerError`, and the outcomes a caller
has to tell apart from it, :class:`Locked`, :class:`Unavailable` and :class:`LimitMismatch`; and
how a broker's error answer maps to them."""

from typing import TYPE_CHECKING, List, Optional, Sequence

if TYPE_CHECKING:
    from ._transport import Answer


class BrokerError(Exception):
    """Something the broker refused, or the client could not do.

    ``status`` is the HTTP status (``None`` when no answer came), ``code`` the broker's error
    code (``invalid_request``, ``unauthorized``, ``forbidden``, ...) or the client's own
    (``closed``, ``unreachable``), and the message one human sentence. Never a token.
    """

    def __init__(self, message: str, *, status: Optional[int] = None, code: Optional[str] = None):
        super().__init__(message)
        self.status = status
        self.code = code


class Locked(BrokerError):
    """Not granted: someone else held the key (or every permit) until the wait ran out.

    ``retry_after`` is the broker's estimate, in seconds, of when the current lease ends
    (``None`` if it gave none). ``busy``: for ``acquire_all``, the keys that were held by
    others (none of the keys is held by the caller afterwards); empty for one key.
    """

    def __init__(self, message: str, *, retry_after: Optional[float] = None,
                 busy: Sequence[str] = ()):
        super().__init__(message, status=409, code="locked")
        self.retry_after = retry_after
        self.busy: List[str] = list(busy)


class Unavailable(BrokerError):
    """The broker could not be reached, or kept answering ``503``, until the wait ran out.

    No lease is returned. The client asked with one ``request_id`` throughout, so at most one
    lease can have been granted unseen (by a broker whose answer never arrived), and it ends by
    its ttl.
    """


class LimitMismatch(BrokerError):
    """A semaphore permit asked for with another ``limit`` than its current holders use.

    ``limit`` is theirs.
    """

    def __init__(self, message: str, *, limit: Optional[int] = None):
        super().__init__(message, status=409, code="limit_mismatch")
        self.limit = limit


class LeaseLost(BrokerError):
    """The lease that ``with_lease`` ran the work under was lost before the work finished (the
    work was cancelled). ``reason`` is the lease's ``lost_reason``."""

    def __init__(self, message: str, *, reason: Optional[str]):
        super().__init__(message, code="lost")
        self.reason = reason


def where(action: str, key: str, url: str) -> str:
    """The start of an error message: what was asked of which key at which broker."""
    return f"{action} {key!r} at {url}"


def error_from(answer: "Answer", context: str) -> BrokerError:
    """The error an answer other than a success stands for; ``context`` (from :func:`where`)
    starts its message."""
    code = answer.code
    status = f"HTTP {answer.status}" + (f" {code}" if code else "")
    message = f"{context}: {answer.message} ({status})"
    if answer.status == 409 and code == "locked":
        held = answer.body.get("held")
        busy = [k for k in held if isinstance(k, str)] if isinstance(held, list) else []
        return Locked(message, retry_after=answer.retry_after(), busy=busy)
    if answer.status == 409 and code == "limit_mismatch":
        limit = answer.body.get("limit")
        return LimitMismatch(message, limit=limit if isinstance(limit, int) else None)
    if answer.status in (429, 502, 503, 504):
        return Unavailable(message, status=answer.status, code=code)
    return BrokerError(message, status=answer.status, code=code)
