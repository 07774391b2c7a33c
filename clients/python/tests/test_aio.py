"""The asyncio client against a real broker: many tasks on one key served in order, a cancelled
waiter leaving nothing behind (also when its grant came after the cancellation), renewals as
tasks on the loop, many open leases without a thread, and the calls beside acquire."""

import asyncio
import threading
import time

import pytest

from conftest import embedded_only
from harness import BrokerProcess, Proxy, hold_first_answer, threads_since
from lockbroker import BrokerError, LeaseLost, Locked
from lockbroker.aio import AsyncBroker, AsyncLease


def waiters(broker: BrokerProcess) -> float:
    return broker.metric("lockbroker_waiters")


def test_twenty_tasks_on_one_key_are_granted_one_at_a_time_in_arrival_order(
    broker: BrokerProcess, key: str
) -> None:
    grants = []
    holding = []
    overlaps = []

    async def task(client: AsyncBroker, i: int) -> None:
        async with await client.acquire(key, ttl=10, wait=30) as lease:
            grants.append((i, lease.fence))
            holding.append(i)
            if len(holding) > 1:
                overlaps.append(list(holding))
            await asyncio.sleep(0.01)
            holding.remove(i)

    async def scenario() -> None:
        async with AsyncBroker(broker.url) as client:
            first = await client.acquire(key, ttl=10)
            before = waiters(broker)
            tasks = []
            for i in range(20):
                tasks.append(asyncio.ensure_future(task(client, i)))
                # Each queued at the broker before the next is started: the arrival order.
                while waiters(broker) < before + i + 1:
                    await asyncio.sleep(0.005)
            await first.release()
            await asyncio.gather(*tasks)

    asyncio.run(scenario())
    assert overlaps == []
    assert [i for i, _ in grants] == list(range(20))
    fences = [fence for _, fence in grants]
    assert fences == sorted(fences) and len(set(fences)) == 20
    assert broker.holders(key) == []


def test_a_waiter_cancelled_by_wait_for_leaves_nothing_queued_or_held(
    broker: BrokerProcess, key: str
) -> None:
    async def scenario() -> None:
        async with AsyncBroker(broker.url) as client:
            holder = await client.acquire(key, ttl=10)
            before = waiters(broker)
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(client.acquire(key, ttl=10, wait=20), 0.5)
            # Out of the queue: the broker drops the waiter when it sees the connection closed,
            # a moment after the cancellation returned.
            deadline = time.monotonic() + 5
            while waiters(broker) != before:
                assert time.monotonic() < deadline, "the cancelled waiter is still queued"
                await asyncio.sleep(0.02)
            await holder.release()
            # Nobody takes the key after the holder: the cancelled waiter is gone.
            assert broker.holders(key) == []
            assert await client.try_acquire(key, ttl=10) is not None

    asyncio.run(scenario())


def test_a_grant_that_arrives_after_the_cancellation_is_released_at_once(
    broker: BrokerProcess, key: str
) -> None:
    proxy = Proxy(broker.url)
    # The broker grants it; its answer is held back until the client was cancelled, then lost:
    # the client cannot know, and must find it again by its request_id.
    granted, resume = hold_first_answer(proxy, "POST", f"/locks/{key}")

    async def scenario() -> None:
        async with AsyncBroker(proxy.url) as client:
            acquire = asyncio.ensure_future(client.acquire(key, ttl=30, wait=5))
            while not granted.is_set():
                await asyncio.sleep(0.01)
            assert broker.holders(key) != []  # granted at the broker, answer not back
            acquire.cancel()
            with pytest.raises(asyncio.CancelledError):
                await acquire
            # Done by the time the cancellation came through: released.
            assert broker.holders(key) == []
            resume.set()

    try:
        asyncio.run(scenario())
        posts = proxy.wait_for(lambda e: e.method == "POST" and e.path == f"/locks/{key}", 2)
        assert len(posts) == 2 and posts[0].json()["request_id"] == posts[1].json()["request_id"]
        assert posts[1].status == 201 and posts[1].answer["fence"] == posts[0].answer["fence"]
        assert [e.status for e in proxy.seen(lambda e: e.method == "DELETE")] == [204]
    finally:
        resume.set()
        proxy.close()


# On one store: 3.5 s, and renewals on Redis are the sync client's tests' business too.
@embedded_only
def test_a_one_second_lease_held_for_three_and_a_half_is_renewed_on_the_loop(
    broker: BrokerProcess, key: str
) -> None:
    async def scenario() -> None:
        before = set(threading.enumerate())
        async with AsyncBroker(broker.url) as client:
            lease = await client.acquire(key, ttl=1.0)
            assert isinstance(lease, AsyncLease)
            lost = []
            lease.on_lost(lambda: lost.append(True))
            first_end = broker.holders(key)[0]["expires_at_ms"]
            await asyncio.sleep(3.5)
            assert lease.held and lost == []
            holders = broker.holders(key)
            assert [h["fence"] for h in holders] == [lease.fence]
            assert holders[0]["expires_at_ms"] > first_end + 2000
            # The renewals are a task of this loop, not a thread.
            assert lease._task is not None and not lease._task.done()
            assert lease._task.get_loop() is asyncio.get_running_loop()
            assert threads_since(before) == []
        assert not lease.held
        assert broker.holders(key) == []

    asyncio.run(scenario())


@embedded_only
def test_fifty_open_leases_add_no_thread_and_close_releases_them(
    broker: BrokerProcess, key: str
) -> None:
    keys = [f"{key}-{i}" for i in range(50)]

    async def scenario() -> None:
        before = set(threading.enumerate())
        async with AsyncBroker(broker.url) as client:
            leases = await asyncio.gather(*(client.acquire(k, ttl=1.5) for k in keys))
            first = [lease.expires_at for lease in leases]
            deadline = time.monotonic() + 10
            while any(lease.expires_at == end for lease, end in zip(leases, first)):
                assert time.monotonic() < deadline, "every lease renewed once"
                await asyncio.sleep(0.05)
            assert all(lease.held for lease in leases)
            assert threads_since(before) == []  # none at all, on a numeric address
        assert not any(lease.held for lease in leases)

    asyncio.run(scenario())
    page = broker.call("GET", f"/locks?prefix={key}-")[1]
    assert page["locks"] == []


@embedded_only
def test_try_acquire_locked_lost_callbacks_and_with_lease(broker: BrokerProcess, key: str) -> None:
    async def scenario() -> None:
        async with AsyncBroker(broker.url) as client, AsyncBroker(broker.url) as other:
            lease = await client.acquire(key, ttl=2.0)
            assert await other.try_acquire(key, ttl=2.0) is None
            with pytest.raises(Locked):
                await other.acquire(key, ttl=2.0, wait=0.2)
            fired = asyncio.Event()
            calls = []

            async def coroutine_callback() -> None:
                calls.append("coroutine")
                fired.set()

            lease.on_lost(lambda: calls.append("plain"))
            lease.on_lost(coroutine_callback)
            assert await other.force_release(key) is True
            await asyncio.wait_for(fired.wait(), 2.0)
            assert calls == ["plain", "coroutine"]
            assert not lease.held and lease.lost_reason == "not_held"
            await lease.release()  # quiet

            assert await client.with_lease(key, 10, 0, _answer) == 42
            assert broker.holders(key) == []

            async def work(lease: AsyncLease) -> None:
                await other.force_release(key)
                await asyncio.sleep(30)  # cancelled when the loss is seen

            started = time.monotonic()
            with pytest.raises(LeaseLost) as lost:
                await client.with_lease(key, 2.0, 0, work)
            assert lost.value.reason == "not_held"
            assert time.monotonic() - started < 2.0

    asyncio.run(scenario())


async def _answer(lease: AsyncLease) -> int:
    assert lease.held
    return 42


@embedded_only
def test_inspect_list_and_bad_keys(broker: BrokerProcess, key: str) -> None:
    async def scenario() -> None:
        async with AsyncBroker(broker.url) as client:
            assert not (await client.inspect(key)).held
            async with await client.acquire(key, ttl=10, owner="me") as lease:
                view = await client.inspect(key)
                assert view.held and view.fence == lease.fence and view.owner == "me"
                page = await client.list(key)
                assert [v.key for v in page.locks] == [key] and page.next_cursor is None
            for bad in ("", "no spaces", "x" * 201):
                with pytest.raises(ValueError) as refused:
                    await client.acquire(bad)
                assert "1 to 200 characters" in str(refused.value)
        with pytest.raises(BrokerError):
            await client.acquire(key)  # closed

    asyncio.run(scenario())


@embedded_only
def test_watch_and_follow(broker: BrokerProcess, key: str) -> None:
    async def scenario() -> None:
        async with AsyncBroker(broker.url) as client, AsyncBroker(broker.url) as writer:
            unchanged = await client.watch(key, 0, wait=0.2)
            assert not unchanged.changed and not unchanged.held
            views = []

            async def follow() -> None:
                async for view in client.follow(key, part=1.0):
                    views.append(view)
                    if len(views) == 2:
                        return

            following = asyncio.ensure_future(follow())
            await asyncio.sleep(0.1)
            lease = await writer.acquire(key, ttl=10)
            seen = await client.watch(key, 0, wait=5)
            assert seen.changed and seen.fence == lease.fence
            await lease.release()
            await asyncio.wait_for(following, 5)
            assert [v.fence for v in views] == [lease.fence, None]

    asyncio.run(scenario())


@embedded_only
def test_acquires_started_together_through_a_proxy_that_drops_100_continue_still_queue_in_order(
    broker: BrokerProcess, key: str
) -> None:
    # The harness proxy answers no `100 Continue`: each acquire after the first sends its body
    # after the client's wait for it (a second), and all are still served in order.
    proxy = Proxy(broker.url)
    grants = []

    async def scenario() -> None:
        async with AsyncBroker(broker.url) as direct, AsyncBroker(proxy.url) as client:
            holder = await direct.acquire(key, ttl=10)
            before = waiters(broker)

            async def task(i: int) -> None:
                async with await client.acquire(key, ttl=10, wait=30) as lease:
                    grants.append((i, lease.fence))

            tasks = [asyncio.ensure_future(task(i)) for i in range(3)]
            while waiters(broker) < before + 3:
                await asyncio.sleep(0.02)
            await holder.release()
            await asyncio.wait_for(asyncio.gather(*tasks), 10)

    try:
        asyncio.run(scenario())
    finally:
        proxy.close()
    assert [i for i, _ in grants] == [0, 1, 2]
    assert [f for _, f in grants] == sorted(f for _, f in grants)


def test_an_acquire_cancelled_while_the_broker_is_unreachable_ends_at_once() -> None:
    from harness import free_port

    async def scenario() -> None:
        async with AsyncBroker(f"http://127.0.0.1:{free_port()}") as client:
            started = time.monotonic()
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(client.acquire("k", ttl=5, wait=10), 0.3)
            # No attempt reached a broker: nothing to clean up, nothing to wait for.
            assert time.monotonic() - started < 1.0

    asyncio.run(scenario())


def test_an_acquire_cancelled_while_it_connects_sends_nothing_and_cleans_up_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A cancellation that lands while the attempt is still connecting: none of its bytes left,
    so the broker cannot have granted it, and the acquire ends without a clean-up request."""
    from harness import free_port

    connects = []

    async def never_connects(*args: object, **kwargs: object) -> None:
        connects.append(args)
        await asyncio.Event().wait()

    monkeypatch.setattr(asyncio, "open_connection", never_connects)

    async def scenario() -> None:
        async with AsyncBroker(f"http://127.0.0.1:{free_port()}", timeout=5) as client:
            started = time.monotonic()
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(client.acquire("k", ttl=5, wait=10), 0.3)
            assert len(connects) == 1, "the cancelled acquire started a clean-up"
            assert time.monotonic() - started < 1.0

    asyncio.run(scenario())
    assert len(connects) == 1


@embedded_only
def test_async_leadership_elects_one_hands_over_on_close_and_revokes_a_lost_term(
    broker: BrokerProcess, key: str
) -> None:
    from lockbroker.aio import AsyncLeadership

    async def scenario() -> None:
        events = []
        async with AsyncBroker(broker.url) as one, AsyncBroker(broker.url) as two:
            a = AsyncLeadership(one, key, "a", ttl=2, part=1)
            b = AsyncLeadership(two, key, "b", ttl=2, part=1)
            elected_b = asyncio.Event()

            async def revoked_a() -> None:
                await asyncio.sleep(0.05)  # awaited: the release waits for it
                events.append(("a revoked", broker.holders(key)[0]["owner"]))

            a.on_elected(lambda lease: events.append(("a elected", lease.fence)))
            a.on_revoked(revoked_a)
            b.on_elected(lambda: (events.append(("b elected", None)), elected_b.set()))
            b.on_revoked(lambda: events.append(("b revoked", None)))
            await a.start()
            while not a.is_leader():
                await asyncio.sleep(0.01)
            await b.start()
            await asyncio.sleep(0.2)
            assert a.leader() == "a" and not b.is_leader()
            await a.close()  # on_revoked, then the release: b next
            await asyncio.wait_for(elected_b.wait(), 5)
            assert b.is_leader() and b.leader() == "b"
            first_fence = b.lease.fence
            elected_b.clear()
            await one.force_release(key)  # b's term is lost: revoked, then elected again
            await asyncio.wait_for(elected_b.wait(), 5)
            assert b.lease.fence > first_fence
            await b.close()
            assert not b.is_leader() and broker.holders(key) == []
        assert [e[0] for e in events] == ["a elected", "a revoked", "b elected", "b revoked",
                                          "b elected", "b revoked"]
        assert events[1][1] == "a"  # a still held the key while its on_revoked ran

    asyncio.run(scenario())
