"""Client for lockbroker, the distributed-lock broker: leases that renew themselves, say when
they are lost, and carry a fence.

    from lockbroker import Broker, Locked

    with Broker("http://127.0.0.1:8080") as broker:
        with broker.acquire("orders:42", ttl=10, wait=5) as lease:
            ...  # write, passing lease.fence to the resource; stop if lease.held turns false

Standard library only; thread-safe. ``lockbroker.aio`` is the asyncio client.
"""

from ._broker import Broker, __version__
from ._calls import Page
from ._errors import BrokerError, LeaseLost, LimitMismatch, Locked, Unavailable
from ._lease import Lease
from ._leadership import Leadership
from ._session import Session, SessionLease
from ._watch import Follower, Holder, KeyView

__all__ = [
    "Broker",
    "BrokerError",
    "Follower",
    "Holder",
    "KeyView",
    "Lease",
    "Leadership",
    "LeaseLost",
    "LimitMismatch",
    "Locked",
    "Page",
    "Session",
    "SessionLease",
    "Unavailable",
    "__version__",
]
