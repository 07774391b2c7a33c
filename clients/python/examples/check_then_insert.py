"""The check-then-insert that duplicates rows behind a load balancer, guarded by lockbroker.

Many request handlers (threads here; Tomcat or gunicorn nodes in production) each check whether
today's business-log row exists and insert it if not. Without a lock, several see "no row" and all
insert. With the lock, one handler at a time runs the check and the insert, and the row's fence
column makes a write from a lease that was lost (and taken over meanwhile) fail instead of
landing.

    python3 examples/check_then_insert.py [BROKER_URL]     # default http://127.0.0.1:8080
"""

import concurrent.futures
import os
import sqlite3
import sys
import tempfile

from lockbroker import Broker, Locked

URL = sys.argv[1] if len(sys.argv) > 1 else os.environ.get("LOCKBROKER_URL", "http://127.0.0.1:8080")
DB = os.path.join(tempfile.mkdtemp(), "business.db")


def setup() -> None:
    with sqlite3.connect(DB) as db:
        db.execute("CREATE TABLE business_log (id INTEGER PRIMARY KEY, start_day TEXT, name TEXT)")
        # The highest fence that wrote, per resource: a write from an older lease is refused.
        db.execute("CREATE TABLE fences (resource TEXT PRIMARY KEY, fence INTEGER NOT NULL)")


def save_once(broker: Broker, day: str, name: str) -> str:
    """The handler: insert the (day, name) row unless it exists."""
    resource = f"business-log:{day}:{name}"
    try:
        with broker.acquire(resource, ttl=10, wait=30) as lease:
            with sqlite3.connect(DB, timeout=30) as db:
                (count,) = db.execute(
                    "SELECT COUNT(*) FROM business_log WHERE start_day = ? AND name = ?",
                    (day, name),
                ).fetchone()
                if count >= 1:
                    return "exists"
                if not lease.held:
                    return "lost the lease: nothing written"  # stop writing
                # The fence check and the insert in one transaction: if a newer lease has
                # written since, this one is refused whatever the lease thinks of itself.
                db.execute("INSERT OR IGNORE INTO fences VALUES (?, 0)", (resource,))
                moved = db.execute(
                    "UPDATE fences SET fence = ? WHERE resource = ? AND fence < ?",
                    (lease.fence, resource, lease.fence),
                ).rowcount
                if moved != 1:
                    db.rollback()
                    return "stale fence: nothing written"
                db.execute(
                    "INSERT INTO business_log (start_day, name) VALUES (?, ?)", (day, name)
                )
                return "inserted"
    except Locked:
        return "busy: try later"


def main() -> None:
    setup()
    with Broker(URL) as broker:
        with concurrent.futures.ThreadPoolExecutor(20) as pool:
            outcomes = list(
                pool.map(lambda _: save_once(broker, "2017-02-10", "no-distributed-lock"), range(200))
            )
    with sqlite3.connect(DB) as db:
        (rows,) = db.execute("SELECT COUNT(*) FROM business_log").fetchone()
    print({o: outcomes.count(o) for o in sorted(set(outcomes))})
    print(f"rows: {rows}")


if __name__ == "__main__":
    main()
