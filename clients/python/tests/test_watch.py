"""Watch, follow and Leadership against real brokers, on the embedded store and on Redis."""

import concurrent.futures
import queue
import threading
import time
from typing import Any, List, Tuple

import pytest

from conftest import Spawner
from harness import BrokerProcess, wait_until
from lockbroker import Broker, KeyView, Leadership

#: Bound on every wait for an event in these tests; a failure past it is a missing event.
BOUND = 15.0


def parked(broker: BrokerProcess, count: int) -> None:
    wait_until(lambda: broker.metric("lockbroker_watchers") >= count, BOUND,
               f"{count} parked watch(es)")


def test_watch_sees_a_grant_and_a_release_and_times_out_unchanged(spawn: Spawner, key: str) -> None:
    broker = spawn.broker()
    with Broker(broker.url) as client, Broker(broker.url, owner="node-a") as holder, \
            concurrent.futures.ThreadPoolExecutor(1) as pool:
        free = client.watch(key, 0, wait=0.2)
        assert (free.changed, free.held, free.fence, free.mode) == (False, False, None, None)

        granted = pool.submit(client.watch, key, 0, BOUND)
        parked(broker, 1)
        assert not granted.done()
        lease = holder.acquire(key, ttl=30)
        view = granted.result(timeout=BOUND)
        assert view.changed and view.held
        assert (view.fence, view.owner, view.mode) == (lease.fence, "node-a", "exclusive")
        assert view.expires_at is not None and view.holders == ()

        same = client.watch(key, lease.fence, wait=0.2)
        assert not same.changed and same.fence == lease.fence and same.owner == "node-a"

        # An out-of-date fence answers at once with the key as it is.
        assert client.watch(key, 0, wait=BOUND).fence == lease.fence

        released = pool.submit(client.watch, key, lease.fence, BOUND)
        parked(broker, 1)
        lease.release()
        view = released.result(timeout=BOUND)
        assert view.changed and not view.held and view.fence is None and view.next_fence == 0
        assert "token" not in repr(view)


def test_watch_shows_shared_holders_and_semaphore_permits(broker: BrokerProcess, key: str) -> None:
    with Broker(broker.url) as client:
        with client.acquire(key, ttl=30, shared=True, owner="r1") as r1, \
                client.acquire(key, ttl=30, shared=True, owner="r2") as r2:
            view = client.watch(key, 0, wait=BOUND)
            assert view.changed and view.mode == "shared" and view.owner is None
            assert view.fence == max(r1.fence, r2.fence)
            assert sorted((h.fence, h.owner) for h in view.holders) == \
                sorted([(r1.fence, "r1"), (r2.fence, "r2")])
        with client.acquire_permit(key, 2, ttl=30, owner="p1") as p1, \
                client.acquire_permit(key, 2, ttl=30, owner="p2") as p2:
            view = client.watch_permits(key, 0, wait=BOUND)
            assert view.changed and view.mode == "permit" and view.limit == 2
            assert view.fence == max(p1.fence, p2.fence)
            assert sorted(h.owner for h in view.holders) == ["p1", "p2"]
            assert not client.watch_permits(key, view.fence, wait=0.2).changed
        # The lock and the semaphore of one name are apart: both free now.
        assert not client.watch_permits(key, 0, wait=0.1).held
        assert not client.watch(key, 0, wait=0.1).held


def test_watch_refuses_bad_input(broker: BrokerProcess) -> None:
    with Broker(broker.url) as client:
        for fence in (-1, "1", 1.5, True):
            with pytest.raises(ValueError):
                client.watch("k", fence, wait=0.1)  # type: ignore[arg-type]
        with pytest.raises(ValueError):
            client.watch("k", 0, wait=-1)
        with pytest.raises(ValueError) as bad_key:
            client.watch("bad key/with slash", 0, wait=0.1)
        assert "1 to 200 characters" in str(bad_key.value)


def test_follow_yields_each_change_once_in_order(broker: BrokerProcess, key: str) -> None:
    seen: "queue.Queue[KeyView]" = queue.Queue()
    with Broker(broker.url) as client, Broker(broker.url) as writer:
        follower = client.follow(key, part=1.0)

        def run() -> None:
            for view in follower:
                seen.put(view)

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        expected: List[Tuple[Any, Any]] = []
        for owner in ("a", "b"):
            lease = writer.acquire(key, ttl=30, owner=owner)
            view = seen.get(timeout=BOUND)
            assert (view.fence, view.owner) == (lease.fence, owner)
            expected.append((lease.fence, owner))
            lease.release()
            view = seen.get(timeout=BOUND)
            assert not view.held
            expected.append((None, None))
        follower.close()
        thread.join(timeout=BOUND)
        assert not thread.is_alive()
        assert seen.empty()  # nothing reported twice
        assert expected[0][0] < expected[2][0]


class Recorder:
    """The callbacks of Leadership instances, as one ordered list of (event, name, fence)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.events: List[Tuple[str, str, int]] = []
        self.changed = threading.Condition(self.lock)

    def attach(self, leadership: Leadership) -> None:
        name = leadership.name

        def elected(lease: Any) -> None:
            with self.changed:
                self.events.append(("elected", name, lease.fence))
                self.changed.notify_all()

        def revoked(lease: Any) -> None:
            with self.changed:
                self.events.append(("revoked", name, lease.fence))
                self.changed.notify_all()

        leadership.on_elected(elected)
        leadership.on_revoked(revoked)

    def wait_for(self, event: Tuple[str, str], timeout: float = BOUND) -> Tuple[str, str, int]:
        deadline = time.monotonic() + timeout
        with self.changed:
            while True:
                for e in self.events:
                    if e[:2] == event:
                        return e
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"no {event} within {timeout} s; saw {self.events}")
                self.changed.wait(left)

    def of(self, name: str) -> List[Tuple[str, str, int]]:
        with self.lock:
            return [e for e in self.events if e[1] == name]


def test_two_candidates_one_leader_and_a_handover_on_close(spawn: Spawner, key: str) -> None:
    broker = spawn.broker()
    recorder = Recorder()
    with Broker(broker.url) as c1, Broker(broker.url) as c2:
        # A ttl far longer than the bounds below: a successor within them was handed the lock,
        # it did not wait for the lease to expire.
        a = Leadership(c1, key, "a", ttl=60)
        b = Leadership(c2, key, "b", ttl=60)
        try:
            recorder.attach(a)
            recorder.attach(b)
            wait_until(lambda: a.is_leader() or b.is_leader(), BOUND, "a leader")
            leader, other = (a, b) if a.is_leader() else (b, a)
            wait_until(lambda: other.leader() == leader.name, BOUND, "the follower to see the leader")
            assert leader.leader() == leader.name
            for _ in range(50):
                assert not (a.is_leader() and b.is_leader())
            assert recorder.of(other.name) == []
            first = recorder.wait_for(("elected", leader.name))
            assert first[2] == leader.lease.fence

            closed_at = time.monotonic()
            leader.close()
            # close() returns after on_revoked ran and the release was sent.
            assert recorder.of(leader.name) == [("elected", leader.name, first[2]),
                                                ("revoked", leader.name, first[2])]
            assert not leader.is_leader()
            second = recorder.wait_for(("elected", other.name), timeout=5.0)
            handover = time.monotonic() - closed_at
            assert second[2] > first[2]
            assert other.is_leader() and other.leader() == other.name
            with recorder.lock:
                order = [e[:2] for e in recorder.events]
            assert order.index(("revoked", leader.name)) < order.index(("elected", other.name))
            print(f"handover on close: {handover * 1000:.0f} ms")

            other.close()
            assert recorder.of(other.name)[-1] == ("revoked", other.name, second[2])
            assert broker.holders(key) == []
            leader.close()  # idempotent
            assert len([e for e in recorder.events if e[0] == "revoked"]) == 2
        finally:
            a.close()
            b.close()


def test_a_lost_lease_is_revoked_before_the_next_campaign(spawn: Spawner, key: str) -> None:
    broker = spawn.broker()
    recorder = Recorder()
    with Broker(broker.url) as client:
        node = Leadership(client, key, "solo", ttl=3)
        try:
            recorder.attach(node)
            first = recorder.wait_for(("elected", "solo"))
            assert broker.call("DELETE", f"/locks/{key}?force=true")[0] == 204
            # Lost (the next renewal is answered 404), revoked, then elected again.
            wait_until(lambda: len(recorder.of("solo")) >= 3, BOUND, "a second term")
            events = recorder.of("solo")
            assert [e[0] for e in events[:3]] == ["elected", "revoked", "elected"]
            assert events[1][2] == first[2] and events[2][2] > first[2]
            assert node.is_leader()
        finally:
            node.close()
        assert recorder.of("solo")[-1][0] == "revoked"
        assert broker.holders(key) == []


def test_closing_the_client_ends_the_term(broker: BrokerProcess, key: str) -> None:
    recorder = Recorder()
    client = Broker(broker.url)
    node = Leadership(client, key, "n", ttl=30)
    try:
        recorder.attach(node)
        recorder.wait_for(("elected", "n"))
        client.close()  # releases every lease of the client, the term's too
        recorder.wait_for(("revoked", "n"))
        assert not node.is_leader()
        assert broker.holders(key) == []
    finally:
        node.close()
    assert [e[0] for e in recorder.of("n")] == ["elected", "revoked"]
