"""Several keys at once (``acquire_all``), sync and asyncio, against a real broker: every key or
none, a fence per key, opposite orders from concurrent callers all served, one request_id for
the retries, renewal of every key, a lost key losing the whole lease (the rest released), release
of all, under a session, and a cancelled asyncio caller leaving nothing behind."""

import asyncio
import threading
import time
from typing import Dict, List

import pytest

from conftest import embedded_only
from harness import BrokerProcess, Exchange, Proxy, hold_first_answer, lost_signal, wait_until
from lockbroker import Broker, Locked
from lockbroker.aio import AsyncBroker


def names(key: str, *suffixes: str) -> List[str]:
    return [f"{key}-{suffix}" for suffix in suffixes]


def fences_at(broker: BrokerProcess, keys: List[str]) -> Dict[str, List[int]]:
    return {k: [h["fence"] for h in broker.holders(k)] for k in keys}


def test_every_key_or_none_with_a_fence_per_key(broker: BrokerProcess, key: str) -> None:
    a, b, c = names(key, "a", "b", "c")
    with Broker(broker.url) as one, Broker(broker.url) as other:
        before = one.acquire(a, ttl=10)
        first_fence = before.fence
        before.release()
        blocker = other.acquire(b, ttl=10)
        with pytest.raises(Locked) as caught:
            one.acquire_all([a, b, c], ttl=10, wait=0.2)
        assert caught.value.busy == [b]
        # None of them is held afterwards, not even the free ones.
        assert fences_at(broker, [a, c]) == {a: [], c: []}
        probe = other.try_acquire(c, ttl=10)  # and c is free for anyone
        assert probe is not None
        probe.release()
        blocker.release()
        lease = one.acquire_all([a, b, c], ttl=10)
        assert lease.held and lease.key == a and lease.fence == lease.fences[a]
        assert list(lease.fences) == [a, b, c]
        assert lease.fences[a] > first_fence
        assert fences_at(broker, [a, b, c]) == {k: [lease.fences[k]] for k in (a, b, c)}
        assert other.try_acquire(c, ttl=10) is None
        lease.release()
        assert fences_at(broker, [a, b, c]) == {a: [], b: [], c: []}
        lease.release()  # idempotent


def test_bad_key_lists_are_refused_before_anything_is_sent(broker: BrokerProcess) -> None:
    with Broker(broker.url) as client:
        with pytest.raises(ValueError, match="1 to 64"):
            client.acquire_all([])
        with pytest.raises(ValueError, match="distinct"):
            client.acquire_all(["x", "y", "x"])
        with pytest.raises(ValueError, match="1 to 64"):
            client.acquire_all([f"k{i}" for i in range(65)])
        with pytest.raises(TypeError):
            client.acquire_all("xy")
        with pytest.raises(ValueError, match="bad key"):
            client.acquire_all(["ok", "not ok"])


def test_opposite_orders_and_single_keys_from_threads_all_complete(
    broker: BrokerProcess, key: str
) -> None:
    x, y = names(key, "x", "y")
    holding = {x: 0, y: 0}
    overlaps: List[str] = []
    grants: List[Dict[str, int]] = []
    errors: List[BaseException] = []
    guard = threading.Lock()
    start = threading.Barrier(3)

    def hold(fences: Dict[str, int]) -> None:
        with guard:
            grants.append(fences)
            for k in fences:
                holding[k] += 1
                if holding[k] > 1:
                    overlaps.append(k)
        time.sleep(0.002)  # the work under the lease
        with guard:
            for k in fences:
                holding[k] -= 1

    def worker(order: List[str]) -> None:
        try:
            with Broker(broker.url) as client:
                start.wait()
                for _ in range(15):
                    if len(order) == 1:
                        with client.acquire(order[0], ttl=10, wait=30) as lease:
                            hold({lease.key: lease.fence})
                    else:
                        with client.acquire_all(order, ttl=10, wait=30) as lease:
                            hold(dict(lease.fences))
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(order,)) for order in ([x, y], [y, x], [x])]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not any(thread.is_alive() for thread in threads), "a worker is stuck"
    assert errors == [] and overlaps == []
    assert len(grants) == 45
    for k in (x, y):
        fences = [g[k] for g in grants if k in g]
        assert fences == sorted(fences) and len(set(fences)) == len(fences)
    assert fences_at(broker, [x, y]) == {x: [], y: []}


def test_a_lost_answer_is_retried_with_the_same_request_id_and_the_same_leases(
    broker: BrokerProcess, key: str
) -> None:
    a, b = names(key, "a", "b")
    proxy = Proxy(broker.url)
    _, resume = hold_first_answer(proxy, "POST", "/locks")
    resume.set()  # the first grant's answer is lost at once
    try:
        with Broker(proxy.url) as client:
            lease = client.acquire_all([a, b], ttl=10, wait=5)
            posts = proxy.seen(lambda e: e.method == "POST" and e.path == "/locks")
            assert len(posts) == 2 and posts[0].dropped
            assert posts[0].json()["request_id"] == posts[1].json()["request_id"]
            assert posts[0].answer["leases"] == posts[1].answer["leases"]
            assert fences_at(broker, [a, b]) == {k: [lease.fences[k]] for k in (a, b)}
            lease.release()
        deletes = proxy.seen(lambda e: e.method == "DELETE")
        assert [(e.path, e.status) for e in deletes] == [(f"/locks?keys={a},{b}", 200)]
        assert [r["status"] for r in deletes[0].answer["results"]] == [204, 204]
        assert fences_at(broker, [a, b]) == {a: [], b: []}
    finally:
        proxy.close()


# Renewal timing: on one store (the renewals are per key, the same on both).
@embedded_only
def test_every_key_is_renewed(broker: BrokerProcess, key: str) -> None:
    a, b, c = names(key, "a", "b", "c")
    with Broker(broker.url) as client:
        lease = client.acquire_all([a, b, c], ttl=1.0)
        lost = lost_signal(lease)
        ends = {k: broker.holders(k)[0]["expires_at_ms"] for k in (a, b, c)}
        time.sleep(2.5)  # well past the ttl: only renewals keep the keys
        assert lease.held and not lost.is_set()
        for k in (a, b, c):
            holders = broker.holders(k)
            assert [h["fence"] for h in holders] == [lease.fences[k]]
            assert holders[0]["expires_at_ms"] > ends[k] + 1000


def test_a_key_lost_by_its_renewal_loses_the_lease_and_releases_the_rest(
    broker: BrokerProcess, key: str
) -> None:
    a, b, c = names(key, "a", "b", "c")
    with Broker(broker.url) as client, Broker(broker.url) as admin:
        lease = client.acquire_all([a, b, c], ttl=1.5)
        lost = lost_signal(lease)
        assert admin.force_release(b) is True
        assert lost.wait(5), "the lease was not lost"
        assert not lease.held and lease.lost_reason == "not_held"
        wait_until(lambda: fences_at(broker, [a, c]) == {a: [], c: []}, 5,
                   "the other keys to be released")
        lease.release()  # quiet: already gone


def test_an_explicit_renew_that_finds_a_key_gone_releases_the_rest(
    broker: BrokerProcess, key: str
) -> None:
    a, b = names(key, "a", "b")
    with Broker(broker.url) as client, Broker(broker.url) as admin:
        lease = client.acquire_all([a, b], ttl=30, auto_renew=False)
        calls: List[bool] = []
        lease.on_lost(lambda: calls.append(True))
        admin.force_release(b)
        assert lease.renew() is False
        assert calls == [True] and not lease.held
        assert fences_at(broker, [a, b]) == {a: [], b: []}


def test_under_a_session_one_keep_alive_keeps_every_key(broker: BrokerProcess, key: str) -> None:
    a, b, c = names(key, "a", "b", "c")
    proxy = Proxy(broker.url)
    try:
        with Broker(proxy.url) as client, Broker(broker.url) as admin:
            session = client.open_session(ttl=1.5)
            lease = session.acquire_all([a, b, c])
            assert [h.get("session") for k in (a, b, c) for h in broker.holders(k)] == [True] * 3
            proxy.wait_for(lambda e: e.method == "POST" and e.path.startswith("/sessions/")
                           and e.path.endswith("/renew"), count=3)
            assert lease.held and lease in session.leases
            assert proxy.seen(lambda e: e.path.startswith("/locks/")) == []
            with pytest.raises(Locked) as caught:
                session.acquire_all([c], wait=0.1)  # not reentrant
            assert caught.value.busy == [c]
            # A key force released: the lease's renew() sees it, and the rest is released
            # while the session lives on.
            admin.force_release(c)
            assert lease.renew() is False and not lease.held
            assert fences_at(broker, [a, b]) == {a: [], b: []}
            again = session.acquire_all([a, b])
            assert again.held and session.alive
            session.close()
            assert not again.held
            assert [e.status for e in proxy.seen(lambda e: e.method == "DELETE"
                                                 and e.path.startswith("/sessions/"))] == [204]
    finally:
        proxy.close()


@pytest.mark.parametrize("broker", ["embedded", "redis"], indirect=True)
def test_closing_the_session_releases_every_key(broker: BrokerProcess, key: str) -> None:
    a, b = names(key, "a", "b")
    with Broker(broker.url) as client:
        session = client.open_session(ttl=10)
        lease = session.acquire_all([a, b])
        session.close()
        assert not lease.held
        assert fences_at(broker, [a, b]) == {a: [], b: []}


def test_asyncio_every_key_or_none_opposite_orders_and_release(
    broker: BrokerProcess, key: str
) -> None:
    x, y, z = names(key, "x", "y", "z")
    holding = {x: 0, y: 0}
    overlaps: List[str] = []
    done: List[Dict[str, int]] = []

    async def worker(client: AsyncBroker, order: List[str]) -> None:
        for _ in range(10):
            async with await client.acquire_all(order, ttl=10, wait=30) as lease:
                for k in order:
                    holding[k] += 1
                    if holding[k] > 1:
                        overlaps.append(k)
                await asyncio.sleep(0.002)
                for k in order:
                    holding[k] -= 1
                done.append(dict(lease.fences))

    async def scenario() -> None:
        async with AsyncBroker(broker.url) as one, AsyncBroker(broker.url) as other:
            blocker = await other.acquire(z, ttl=10)
            with pytest.raises(Locked) as caught:
                await one.acquire_all([x, z], ttl=10, wait=0.2)
            assert caught.value.busy == [z]
            assert broker.holders(x) == []
            await blocker.release()
            await asyncio.wait_for(asyncio.gather(worker(one, [x, y]), worker(other, [y, x])),
                                   60)
            lease = await one.acquire_all([x, y, z])
            assert lease.key == x and list(lease.fences) == [x, y, z]
            await lease.release()
            assert not lease.held

    asyncio.run(scenario())
    assert overlaps == [] and len(done) == 20
    assert fences_at(broker, [x, y, z]) == {x: [], y: [], z: []}


def test_asyncio_a_lost_key_loses_the_lease_and_the_rest_is_released(
    broker: BrokerProcess, key: str
) -> None:
    a, b = names(key, "a", "b")

    async def scenario() -> None:
        async with AsyncBroker(broker.url) as client, AsyncBroker(broker.url) as admin:
            lease = await client.acquire_all([a, b], ttl=1.5)
            lost = asyncio.Event()
            lease.on_lost(lost.set)
            assert await admin.force_release(a) is True
            await asyncio.wait_for(lost.wait(), 5)
            assert not lease.held and lease.lost_reason == "not_held"
            deadline = time.monotonic() + 5
            while broker.holders(b) != []:
                assert time.monotonic() < deadline, "the other key is still held"
                await asyncio.sleep(0.02)

    asyncio.run(scenario())


def test_asyncio_a_grant_that_arrives_after_the_cancellation_is_released(
    broker: BrokerProcess, key: str
) -> None:
    a, b = names(key, "a", "b")
    proxy = Proxy(broker.url)
    granted, resume = hold_first_answer(proxy, "POST", "/locks")

    async def scenario() -> None:
        async with AsyncBroker(proxy.url) as client:
            acquire = asyncio.ensure_future(client.acquire_all([a, b], ttl=30, wait=5))
            while not granted.is_set():
                await asyncio.sleep(0.01)
            assert broker.holders(a) != [] and broker.holders(b) != []
            acquire.cancel()
            with pytest.raises(asyncio.CancelledError):
                await acquire
            assert fences_at(broker, [a, b]) == {a: [], b: []}
            resume.set()

    try:
        asyncio.run(scenario())
        posts = proxy.wait_for(lambda e: e.method == "POST" and e.path == "/locks", 2)
        assert posts[0].json()["request_id"] == posts[1].json()["request_id"]
        assert posts[1].answer["leases"] == posts[0].answer["leases"]
        assert [e.path for e in proxy.seen(lambda e: e.method == "DELETE")] == \
            [f"/locks?keys={a},{b}"]
    finally:
        resume.set()
        proxy.close()


def test_asyncio_a_waiter_cancelled_holds_nothing(broker: BrokerProcess, key: str) -> None:
    a, b = names(key, "a", "b")

    async def scenario() -> None:
        async with AsyncBroker(broker.url) as client, AsyncBroker(broker.url) as other:
            holder = await other.acquire(b, ttl=10)
            before = broker.metric("lockbroker_waiters")
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(client.acquire_all([a, b], ttl=10, wait=20), 0.5)
            assert broker.holders(a) == []
            # Out of the queue a moment after the cancellation returned (the broker sees the
            # connection closed).
            deadline = time.monotonic() + 5
            while broker.metric("lockbroker_waiters") > before:
                assert time.monotonic() < deadline, "the cancelled waiter is still queued"
                await asyncio.sleep(0.02)
            await holder.release()
            # Nobody takes the keys after the holder: the cancelled waiter is gone.
            assert fences_at(broker, [a, b]) == {a: [], b: []}

    asyncio.run(scenario())


def test_a_503_is_retried_with_the_same_request_id(broker: BrokerProcess, key: str) -> None:
    a, b = names(key, "a", "b")
    proxy = Proxy(broker.url)
    refused: List[Exchange] = []

    def refuse_the_first(exchange: Exchange) -> "int | None":
        if exchange.method == "POST" and exchange.path == "/locks" and not refused:
            refused.append(exchange)
            return 503
        return None

    proxy.refuse = refuse_the_first
    try:
        with Broker(proxy.url) as client:
            lease = client.acquire_all([a, b], ttl=10, wait=5)
            posts = proxy.seen(lambda e: e.method == "POST" and e.path == "/locks")
            assert [e.status for e in posts] == [503, 201]
            assert posts[0].json()["request_id"] == posts[1].json()["request_id"]
            assert fences_at(broker, [a, b]) == {k: [lease.fences[k]] for k in (a, b)}
    finally:
        proxy.close()


def test_asyncio_under_a_session(broker: BrokerProcess, key: str) -> None:
    a, b = names(key, "a", "b")

    async def scenario() -> None:
        async with AsyncBroker(broker.url) as client:
            async with await client.open_session(ttl=10) as session:
                lease = await session.acquire_all([a, b])
                assert list(lease.fences) == [a, b] and lease.held
                assert [h.get("session") for k in (a, b) for h in broker.holders(k)] == [True] * 2
                assert await lease.renew() is True
                await lease.release()  # these keys only: the session goes on
                assert not lease.held and session.alive and session.leases == []
                assert fences_at(broker, [a, b]) == {a: [], b: []}

    asyncio.run(scenario())
