"""What the client does when things fail: a broker that stops, a Redis that hangs or restarts
(the broker answers 503), an answer lost on the way back. Each test has brokers of its own."""

import concurrent.futures
import contextlib
import threading
import time
from typing import Any, Iterator, Tuple

import pytest

from conftest import Spawner
from harness import Exchange, lost_signal, wait_until
from lockbroker import Broker, Lease, Unavailable


def posts_to(key: str, space: str = "locks"):
    return lambda e: e.method == "POST" and e.path == f"/{space}/{key}"


def renewals_of(key: str):
    return lambda e: e.method == "POST" and e.path == f"/locks/{key}/renew"


def test_lost_within_the_ttl_when_the_broker_stops(spawn: Spawner, key: str) -> None:
    ttl = 2.0
    broker = spawn.broker()
    with Broker(broker.url) as client:
        lease = client.acquire(key, ttl=ttl)
        fired = lost_signal(lease)
        broker.kill()
        killed = time.monotonic()
        assert fired.wait(ttl), "no lost signal within the ttl"
        assert time.monotonic() - killed < ttl
        assert not lease.held
        assert lease.lost_reason == "expired"
        lease.release()  # quiet: the lease has ended, nobody can be asked


def test_leaving_a_with_block_when_the_broker_is_gone_does_not_fail_the_block(
    spawn: Spawner, key: str, caplog: pytest.LogCaptureFixture
) -> None:
    broker = spawn.broker()
    with Broker(broker.url, timeout=0.5) as client:
        with client.acquire(key, ttl=30) as lease:
            broker.kill()
        assert not lease.held
        with pytest.raises(Unavailable):
            lease.release()  # asked directly, it says the lease may still stand
    assert any("could not release" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("shared", [False, True], ids=["exclusive", "shared"])
def test_a_grant_whose_answer_was_lost_is_found_again_not_granted_twice(
    spawn: Spawner, key: str, shared: bool
) -> None:
    broker = spawn.broker()
    proxy = spawn.proxy(broker)
    dropped = []

    def drop_first_grant(exchange: Exchange) -> bool:
        if posts_to(key)(exchange) and not dropped:
            dropped.append(exchange)
            return True
        return False

    proxy.drop = drop_first_grant
    with Broker(proxy.url) as client:
        lease = client.acquire(key, ttl=30, wait=5, shared=shared)
        # The broker did grant the first attempt; its answer never reached the client, whose
        # repeat (same request_id) was answered that same lease.
        assert dropped[0].status == 201
        assert dropped[0].answer["fence"] == lease.fence
        attempts = proxy.seen(posts_to(key))
        assert len(attempts) == 2
        assert len({a.json()["request_id"] for a in attempts}) == 1
        assert [h["fence"] for h in broker.holders(key)] == [lease.fence]
        lease.release()
        assert broker.holders(key) == []


def test_a_503_is_retried_after_retry_after_with_the_same_request_id(spawn: Spawner, key: str) -> None:
    # One waiter at most: while another request waits, a second one that must wait is answered
    # 503 too_many_waiters with Retry-After.
    broker = spawn.broker("--max-waiters", "1")
    proxy = spawn.proxy(broker)
    with Broker(broker.url) as other, Broker(proxy.url) as client:
        holder = other.acquire(key, ttl=30)
        filler_key = key + "-filler"
        filler_holder = other.acquire(filler_key, ttl=30)
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            filler = pool.submit(other.acquire, filler_key, 30, 20)
            wait_until(lambda: broker.metric("lockbroker_waiters") == 1, 10, "the filler to wait")
            future = pool.submit(lambda: client.acquire(key, ttl=30, wait=20, shared=True))
            refused = proxy.wait_for(lambda e: posts_to(key)(e) and e.status == 503)[0]
            assert refused.answer["error"] == "too_many_waiters"
            filler_holder.release()
            filler.result(timeout=10).release()
            holder.release()
            lease = future.result(timeout=20)
        attempts = proxy.seen(posts_to(key))
        assert len(attempts) >= 2 and attempts[-1].status == 201
        assert len({a.json()["request_id"] for a in attempts}) == 1
        assert [h["fence"] for h in broker.holders(key)] == [lease.fence]
        lease.release()
        assert broker.holders(key) == []


def test_a_load_balancers_502_and_504_are_retried(spawn: Spawner, key: str) -> None:
    broker = spawn.broker()
    proxy = spawn.proxy(broker)
    statuses = [502, 504]
    proxy.refuse = lambda e: statuses.pop(0) if posts_to(key)(e) and statuses else None
    with Broker(proxy.url) as client:
        lease = client.acquire(key, ttl=30, wait=5)
        attempts = proxy.seen(posts_to(key))
        assert [a.status for a in attempts] == [502, 504, 201]
        assert len({a.json()["request_id"] for a in attempts}) == 1
        lease.release()


def test_a_waiting_acquire_survives_a_broker_restart(spawn: Spawner, key: str) -> None:
    redis = spawn.redis() if spawn.store == "redis" else None
    broker = spawn.broker(redis=redis)
    proxy = spawn.proxy(broker)
    with Broker(proxy.url) as client, Broker(broker.url) as other:
        # Not renewed: on Redis it outlives the restart and ends by its ttl.
        holder = other.acquire(key, ttl=1.5, auto_renew=False)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            future = pool.submit(lambda: client.acquire(key, ttl=30, wait=20))
            wait_until(lambda: broker.metric("lockbroker_waiters") == 1, 10, "the acquire to wait")
            # The broker answers its waiters 503 shutting_down; while it is down the client's
            # repeats find nobody (no answer), then the restarted broker grants.
            broker.terminate()
            proxy.wait_for(lambda e: posts_to(key)(e) and e.status == 503)
            broker.restart()
            lease = future.result(timeout=20)
        attempts = proxy.seen(posts_to(key))
        assert attempts[0].status == 503 and attempts[0].answer["error"] == "shutting_down"
        assert attempts[-1].status == 201
        assert len({a.json()["request_id"] for a in attempts}) == 1
        assert lease.fence > holder.fence
        assert [h["fence"] for h in broker.holders(key)] == [lease.fence]
        lease.release()


@pytest.mark.parametrize("outage", ["stopped", "hung"])
def test_503s_from_a_redis_outage_are_retried_with_one_request_id_and_one_grant(
    redis_spawn: Spawner, key: str, outage: str
) -> None:
    redis, broker, proxy = redis_spawn.on_redis_behind_proxy()
    # Waits asked for in parts of 0.3 s: the broker answers each part's end with 503 while Redis
    # is out (a longer part it would wait out itself), and the client asks again.
    with Broker(proxy.url, max_wait=0.3) as client:
        redis.stop() if outage == "stopped" else redis.pause()
        try:
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                # Shared, so that a second grant would show as a second holder.
                future = pool.submit(lambda: client.acquire(key, ttl=30, wait=15, shared=True))
                proxy.wait_for(lambda e: posts_to(key)(e) and e.status == 503, count=2)
                # Back: empty after a stop (the broker settles, then grants); after a hang,
                # Redis runs the claims queued meanwhile, and the repeat finds that grant.
                redis.restart() if outage == "stopped" else redis.resume()
                lease = future.result(timeout=20)
        finally:
            if outage == "hung":
                redis.resume()
        attempts = proxy.seen(posts_to(key))
        assert attempts[-1].status == 201
        assert len({a.json()["request_id"] for a in attempts}) == 1
        assert [h["fence"] for h in broker.holders(key)] == [lease.fence]
        lease.release()
        assert broker.holders(key) == []


def test_a_redis_outage_is_unavailable_at_once_and_waited_out_within_the_wait(
    redis_spawn: Spawner, key: str
) -> None:
    redis, broker, proxy = redis_spawn.on_redis_behind_proxy()
    with Broker(proxy.url) as client:
        redis.stop()
        with pytest.raises(Unavailable) as refused:
            client.try_acquire(key, ttl=30)
        assert refused.value.status == 503 and refused.value.code == "store_unavailable"
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            future = pool.submit(lambda: client.acquire(key, ttl=30, wait=15, shared=True))
            wait_until(lambda: proxy.seen(lambda e: posts_to(key)(e) and e.status is None), 10,
                       "the acquire to reach the broker")
            # Back empty: the broker settles (a hold) and then grants, within the wait.
            redis.restart()
            lease = future.result(timeout=20)
        assert lease.held
        assert [h["fence"] for h in broker.holders(key)] == [lease.fence]
        lease.release()


@contextlib.contextmanager
def leased_behind_proxy(
    redis_spawn: Spawner, key: str, ttl: float
) -> Iterator[Tuple[Any, Any, Lease, threading.Event]]:
    """A lease on ``key`` taken through a recording proxy in front of a broker on a Redis of the
    test's own: the Redis, the proxy, the lease and its lost signal."""
    redis, _, proxy = redis_spawn.on_redis_behind_proxy()
    with Broker(proxy.url) as client:
        lease = client.acquire(key, ttl=ttl)
        yield redis, proxy, lease, lost_signal(lease)


def test_renewals_answered_503_are_retried_and_the_lease_kept(redis_spawn: Spawner, key: str) -> None:
    with leased_behind_proxy(redis_spawn, key, ttl=4.0) as (redis, proxy, lease, fired):
        proxy.wait_for(lambda e: renewals_of(key)(e) and e.status == 200)
        redis.pause()
        try:
            failed = proxy.wait_for(lambda e: renewals_of(key)(e) and e.status == 503)
        finally:
            redis.resume()
        # A renewal after the 503 went through.
        proxy.wait_for(lambda e: renewals_of(key)(e) and e.status == 200
                       and proxy.exchanges.index(e) > proxy.exchanges.index(failed[0]))
        assert lease.held and not fired.is_set()
        lease.release()


def test_lost_within_the_ttl_when_renewals_keep_answering_503(redis_spawn: Spawner, key: str) -> None:
    ttl = 2.0
    with leased_behind_proxy(redis_spawn, key, ttl) as (redis, proxy, lease, fired):
        redis.pause()
        paused = time.monotonic()
        try:
            assert fired.wait(ttl), "no lost signal within the ttl"
            assert time.monotonic() - paused < ttl
            assert proxy.seen(lambda e: renewals_of(key)(e) and e.status == 503)
        finally:
            redis.resume()
        assert lease.lost_reason == "expired" and not lease.held
        lease.release()


def test_no_renewal_after_close(spawn: Spawner, key: str) -> None:
    broker = spawn.broker()
    proxy = spawn.proxy(broker)
    client = Broker(proxy.url)
    lease = client.acquire(key, ttl=0.6)  # renewed every 0.2 s
    proxy.wait_for(lambda e: renewals_of(key)(e) and e.status == 200, count=2)
    client.close()
    renewals = len(proxy.seen(renewals_of(key)))
    counted = broker.metric("lockbroker_renewals_total")
    # Three renewal periods: a renewal still scheduled would show, at the proxy and the broker.
    time.sleep(0.6)
    assert len(proxy.seen(renewals_of(key))) == renewals
    assert broker.metric("lockbroker_renewals_total") == counted
    assert not lease.held
    assert broker.holders(key) == []
