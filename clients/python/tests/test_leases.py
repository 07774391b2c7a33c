"""Grants, waits, refusals, renewals, release and the lost signal, against a real broker on the
embedded store and on Redis."""

import concurrent.futures
import logging
import threading
import time

import pytest

from harness import BrokerProcess, Proxy, lost_signal, wait_until
from lockbroker import Broker, BrokerError, LimitMismatch, Locked, Unavailable


def test_acquire_grants_a_lease_with_a_fence_and_release_ends_it(broker: BrokerProcess, key: str) -> None:
    with Broker(broker.url) as client:
        lease = client.acquire(key, ttl=10)
        assert lease.key == key
        assert isinstance(lease.fence, int) and lease.fence > 0
        assert lease.held
        assert [h["fence"] for h in broker.holders(key)] == [lease.fence]
        lease.release()
        assert not lease.held
        assert broker.holders(key) == []
        lease.release()  # idempotent
        again = client.acquire(key, ttl=10)
        assert again.fence > lease.fence
        again.release()


def test_with_block_releases_on_exit_even_when_the_block_raises(broker: BrokerProcess, key: str) -> None:
    with Broker(broker.url) as client:
        with client.acquire(key, ttl=10) as lease:
            assert broker.holders(key) != []
        assert not lease.held
        assert broker.holders(key) == []
        with pytest.raises(RuntimeError):
            with client.acquire(key, ttl=10):
                raise RuntimeError("the work failed")
        assert broker.holders(key) == []


def test_a_held_key_is_locked_and_try_acquire_gives_none(broker: BrokerProcess, key: str) -> None:
    with Broker(broker.url) as client:
        with client.acquire(key, ttl=10):
            with pytest.raises(Locked) as refused:
                client.acquire(key, ttl=10)
            assert refused.value.retry_after is not None and refused.value.retry_after > 0
            assert isinstance(refused.value, BrokerError)
            with pytest.raises(Locked):
                client.acquire(key, ttl=10, wait=0.2)
            assert client.try_acquire(key, ttl=10) is None


def test_a_waiting_acquire_is_granted_when_the_holder_releases(broker: BrokerProcess, key: str) -> None:
    with Broker(broker.url) as client:
        first = client.acquire(key, ttl=10)
        waiters_before = broker.metric("lockbroker_waiters")
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            second = pool.submit(client.acquire, key, 10, 20)
            # The broker holds the request (the client does not poll): it shows as a waiter.
            wait_until(lambda: broker.metric("lockbroker_waiters") > waiters_before, 10,
                       "the acquire to wait in the broker")
            assert not second.done()
            first.release()
            lease = second.result(timeout=10)
        assert lease.held and lease.fence > first.fence
        assert [h["fence"] for h in broker.holders(key)] == [lease.fence]
        lease.release()


def test_a_lease_granted_after_a_long_wait_is_renewed_before_acquire_returns(
    broker: BrokerProcess, key: str
) -> None:
    proxy = Proxy(broker.url)
    try:
        with Broker(broker.url) as other, Broker(proxy.url) as client:
            # Not renewed: it ends by itself after a second, well past a third of the waiter's
            # ttl, so the client cannot tell from its own clock when the grant happened.
            holder = other.acquire(key, ttl=1.0, auto_renew=False)
            lease = client.acquire(key, ttl=0.9, wait=10)
            renewals = proxy.seen(lambda e: e.path == f"/locks/{key}/renew")
            assert len(renewals) >= 1 and renewals[0].status == 200
            assert lease.held and lease.fence > holder.fence
            lease.release()
    finally:
        proxy.close()


def test_auto_renew_holds_a_lease_for_more_than_three_ttls(broker: BrokerProcess, key: str) -> None:
    ttl = 1.0
    with Broker(broker.url) as client:
        lease = client.acquire(key, ttl=ttl)
        lost = lost_signal(lease)
        start = time.monotonic()
        first_end = broker.holders(key)[0]["expires_at_ms"]
        # The broker's own record of the lease moves on, renewal after renewal, until it ends
        # more than three ttls after the first grant's end.
        wait_until(lambda: broker.holders(key)[0]["expires_at_ms"] > first_end + 3 * ttl * 1000,
                   15, "renewals past 3 ttls")
        assert time.monotonic() - start > 2 * ttl
        assert lease.held and not lost.is_set()
        assert [h["fence"] for h in broker.holders(key)] == [lease.fence]
        other = client.try_acquire(key, ttl=ttl)
        assert other is None
        lease.release()


@pytest.mark.parametrize("kind", ["shared", "permit"])
def test_shared_leases_and_permits_renew_too(broker: BrokerProcess, key: str, kind: str) -> None:
    space = "semaphores" if kind == "permit" else "locks"
    label = f'space="{space}",result="renewed"'
    with Broker(broker.url) as client:
        if kind == "permit":
            lease = client.acquire_permit(key, 3, ttl=0.6)
        else:
            lease = client.acquire(key, ttl=0.6, shared=True)
        before = broker.metric("lockbroker_renewals_total", label)
        first_end = broker.holders(key, space)[0]["expires_at_ms"]
        wait_until(lambda: broker.metric("lockbroker_renewals_total", label) >= before + 3, 10,
                   "three renewals")
        assert broker.holders(key, space)[0]["expires_at_ms"] > first_end
        assert lease.held
        lease.release()
        assert broker.holders(key, space) == []


def test_a_bearer_token_is_sent_and_a_refusal_is_an_error(tmp_path, key: str) -> None:
    auth = tmp_path / "auth.toml"
    auth.write_text(
        '[[tokens]]\nname = "orders-app"\ntoken = "orders-secret-0123456789"\n'
        'prefixes = ["py-"]\npermissions = ["lock"]\n'
    )
    broker = BrokerProcess(None, ("--auth-file", str(auth)))
    try:
        with Broker(broker.url, token="orders-secret-0123456789") as client:
            assert "orders-secret" not in repr(client)
            client.acquire(key, ttl=10).release()
            with pytest.raises(BrokerError) as outside:
                client.acquire("elsewhere", ttl=10)
            assert outside.value.status == 403 and outside.value.code == "forbidden"
        with Broker(broker.url) as anonymous:
            with pytest.raises(BrokerError) as refused:
                anonymous.acquire(key, ttl=10)
            assert refused.value.status == 401
    finally:
        broker.close()


def test_lost_after_a_force_release_within_the_ttl(broker: BrokerProcess, key: str) -> None:
    ttl = 2.0
    with Broker(broker.url) as client:
        lease = client.acquire(key, ttl=ttl)
        calls = []
        fired = threading.Event()

        def on_lost(which) -> None:
            calls.append((which, threading.current_thread()))
            fired.set()

        lease.on_lost(on_lost)
        status, _ = broker.call("DELETE", f"/locks/{key}?force=true")
        assert status == 204
        forced = time.monotonic()
        assert fired.wait(ttl), "no lost signal within the ttl"
        assert time.monotonic() - forced < ttl
        assert not lease.held
        assert lease.lost_reason == "not_held"
        assert calls[0][0] is lease
        assert calls[0][1] is not threading.current_thread()  # a client thread
        # A callback registered after the loss runs at once, in the call.
        late = []
        lease.on_lost(lambda: late.append(True))
        assert late == [True]
        lease.release()  # quiet: the broker answers 404
        assert len(calls) == 1  # once


def test_lost_with_not_owner_when_someone_else_took_the_key(broker: BrokerProcess, key: str) -> None:
    with Broker(broker.url) as client:
        lease = client.acquire(key, ttl=2.0)
        fired = lost_signal(lease)
        assert broker.call("DELETE", f"/locks/{key}?force=true")[0] == 204
        taker = client.acquire(key, ttl=10)
        assert fired.wait(2.0)
        assert lease.lost_reason in ("not_owner", "not_held")
        lease.release()  # 409 not_owner: quiet, and the new holder keeps the key
        assert [h["fence"] for h in broker.holders(key)] == [taker.fence]
        taker.release()


def test_release_stops_renewals_for_good(broker: BrokerProcess, key: str) -> None:
    with Broker(broker.url) as client:
        lease = client.acquire(key, ttl=0.6)  # renewed every 0.2 s
        before = broker.metric("lockbroker_renewals_total")
        wait_until(lambda: broker.metric("lockbroker_renewals_total") >= before + 2, 10,
                   "two renewals")
        lease.release()
        after = broker.metric("lockbroker_renewals_total")
        # Three renewal periods: a renewal still scheduled would show.
        time.sleep(0.6)
        assert broker.metric("lockbroker_renewals_total") == after
        assert not lease.held


def test_shared_leases_coexist_and_keep_an_exclusive_one_out(broker: BrokerProcess, key: str) -> None:
    with Broker(broker.url) as client:
        a = client.acquire(key, ttl=10, shared=True)
        b = client.acquire(key, ttl=10, shared=True)
        assert a.mode == b.mode == "shared"
        assert sorted(h["fence"] for h in broker.holders(key)) == sorted([a.fence, b.fence])
        assert client.try_acquire(key, ttl=10) is None
        a.release()
        b.release()
        exclusive = client.try_acquire(key, ttl=10)
        assert exclusive is not None and exclusive.mode == "exclusive"
        exclusive.release()


def test_semaphore_permits(broker: BrokerProcess, key: str) -> None:
    with Broker(broker.url) as client:
        one = client.acquire_permit(key, 2, ttl=10)
        two = client.acquire_permit(key, 2, ttl=10)
        assert one.mode == "permit" and one.limit == 2
        assert client.try_acquire_permit(key, 2, ttl=10) is None
        with pytest.raises(Locked):
            client.acquire_permit(key, 2, ttl=10, wait=0.1)
        with pytest.raises(LimitMismatch) as mismatch:
            client.acquire_permit(key, 3, ttl=10)
        assert mismatch.value.limit == 2
        # Semaphore keys are apart from lock keys.
        client.acquire(key, ttl=10).release()
        one.release()
        three = client.acquire_permit(key, 2, ttl=10)
        assert len(broker.holders(key, "semaphores")) == 2
        two.release()
        three.release()
        assert broker.holders(key, "semaphores") == []


def test_ownership_is_the_lease_not_the_thread(broker: BrokerProcess, key: str) -> None:
    with Broker(broker.url) as client:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            lease = pool.submit(client.acquire, key, 10).result()
            assert pool.submit(lambda: lease.held).result()
            pool.submit(lease.release).result()
        assert broker.holders(key) == []


def test_concurrent_acquirers_get_one_lease_at_a_time(broker: BrokerProcess, key: str) -> None:
    holding = []
    overlaps = []
    lock = threading.Lock()

    def work(client: Broker) -> int:
        with client.acquire(key, ttl=10, wait=30) as lease:
            with lock:
                holding.append(lease.fence)
                if len(holding) > 1:
                    overlaps.append(list(holding))
            time.sleep(0.01)
            with lock:
                holding.remove(lease.fence)
            return lease.fence

    with Broker(broker.url) as client:
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            fences = list(pool.map(lambda _: work(client), range(16)))
    assert overlaps == []
    assert len(set(fences)) == 16


def test_close_releases_open_leases_and_refuses_new_ones(broker: BrokerProcess, key: str) -> None:
    client = Broker(broker.url)
    lease = client.acquire(key, ttl=10)
    shared = client.acquire(key + "-s", ttl=10, shared=True)
    client.close()
    assert not lease.held and not shared.held
    assert broker.holders(key) == [] and broker.holders(key + "-s") == []
    with pytest.raises(BrokerError):
        client.acquire(key, ttl=10)
    client.close()  # idempotent


def test_the_token_is_never_shown(broker: BrokerProcess, key: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="lockbroker")
    with Broker(broker.url) as client:
        lease = client.acquire(key, ttl=0.6)
        token = lease._token
        fired = lost_signal(lease)
        broker.call("DELETE", f"/locks/{key}?force=true")
        assert fired.wait(5)
        lease.release()
        shown = [repr(lease), str(lease), repr(client)] + [r.getMessage() for r in caplog.records]
        assert caplog.records, "the loss is logged"
        assert all(token not in text for text in shown)


def test_bad_input_is_refused_before_anything_is_sent(broker: BrokerProcess) -> None:
    proxy = Proxy(broker.url)
    try:
        with Broker(proxy.url) as client:
            with pytest.raises(ValueError):
                client.acquire("k", ttl=0)
            with pytest.raises(ValueError):
                client.acquire("k", ttl=1, wait=-1)
            with pytest.raises(ValueError) as empty:
                client.acquire("")
            assert str(empty.value) == \
                "a key is required (1 to 200 characters from A-Z a-z 0-9 . _ - :)"
            for bad in ("no spaces/or slashes", "x" * 201, "caf\u00e9"):
                with pytest.raises(ValueError) as bad_key:
                    client.acquire(bad, ttl=1)
                assert "a key is 1 to 200 characters from A-Z a-z 0-9 . _ - :" in str(bad_key.value)
                with pytest.raises(ValueError):
                    client.try_acquire_permit(bad, 2)
            assert proxy.exchanges == []
    finally:
        proxy.close()


def test_an_unreachable_broker_is_unavailable_after_the_wait() -> None:
    from harness import free_port

    with Broker(f"http://127.0.0.1:{free_port()}") as client:
        start = time.monotonic()
        with pytest.raises(Unavailable):
            client.acquire("k", ttl=1, wait=0.5)
        assert time.monotonic() - start >= 0.5
        with pytest.raises(Unavailable):
            client.try_acquire("k", ttl=1)
