"""The errors the client raises: one base class, :class:`BrokerError`, and the outcomes a caller
has to tell apart from it, :class:`Locked`, :class:`Unavailable` and :class:`LimitMismatch`; and
how a broker's error answer maps to them."""

from typing import TYPE_CHECKING, Optional

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
    (``None`` if it gave none).
    """

    def __init__(self, message: str, *, retry_after: Optional[float] = None):
        super().__init__(message, status=409, code="locked")
        self.retry_after = retry_after


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


def error_from(answer: "Answer") -> BrokerError:
    """The error an answer other than a success stands for."""
    code = answer.code
    if answer.status == 409 and code == "locked":
        return Locked(answer.message, retry_after=answer.retry_after())
    if answer.status == 409 and code == "limit_mismatch":
        limit = answer.body.get("limit")
        return LimitMismatch(answer.message, limit=limit if isinstance(limit, int) else None)
    if answer.status in (502, 503, 504):
        return Unavailable(answer.message, status=answer.status, code=code)
    return BrokerError(answer.message, status=answer.status, code=code)
