"""The sync client's renewal thread, refusals that end things at once (a revoked token, a wrong
token for an election, a 5xx the broker never sends), the renewal-trouble hook, from_env,
with_lease, and inspect / list / force release."""

import pathlib
import signal
import threading
import time
from typing import Iterator, List, Optional

import pytest

from conftest import embedded_only
from harness import BrokerProcess, Proxy, lost_signal, threads_since, wait_until
from lockbroker import Broker, BrokerError, Leadership, Unavailable

SECRET = "orders-secret-0123456789"
AUTH = ('[[tokens]]\nname = "orders-app"\ntoken = "%s"\nprefixes = ["py-"]\n'
        'permissions = ["lock"]\n')


@pytest.fixture
def auth_broker(tmp_path: pathlib.Path) -> Iterator[BrokerProcess]:
    auth = tmp_path / "auth.toml"
    auth.write_text(AUTH % SECRET)
    process = BrokerProcess(None, ("--auth-file", str(auth)))
    process.auth_file = auth  # type: ignore[attr-defined]
    yield process
    process.close()


@embedded_only
def test_three_hundred_leases_are_renewed_by_one_thread(broker: BrokerProcess, key: str) -> None:
    before = set(threading.enumerate())
    with Broker(broker.url) as client:
        leases = [client.acquire(f"{key}-{i}", ttl=2.0) for i in range(300)]
        first = {lease.key: lease.expires_at for lease in leases}
        wait_until(lambda: all(lease.expires_at != first[lease.key] for lease in leases), 10,
                   "every lease renewed once")
        assert all(lease.held for lease in leases)
        assert [t.name for t in threads_since(before)] == ["lockbroker-renewer"]
    assert threads_since(before) == []  # the renewal thread stopped with the Broker
    assert not any(lease.held for lease in leases)


def test_a_revoked_token_loses_the_lease_as_unauthorized(auth_broker: BrokerProcess, key: str) -> None:
    with Broker(auth_broker.url, token=SECRET) as client:
        lease = client.acquire(key, ttl=1.5)
        lost = lost_signal(lease)
        auth_broker.auth_file.write_text(AUTH % "another-secret-0123456789")  # type: ignore[attr-defined]
        auth_broker.proc.send_signal(signal.SIGHUP)
        assert lost.wait(1.5)
        assert lease.lost_reason == "unauthorized"


def test_leadership_with_a_wrong_token_raises(auth_broker: BrokerProcess, key: str) -> None:
    before = set(threading.enumerate())
    with Broker(auth_broker.url, token="wrong-secret-0123456789") as client:
        with pytest.raises(BrokerError) as refused:
            Leadership(client, key, "node-a", ttl=2)
        assert refused.value.status == 401
        assert key in str(refused.value) and auth_broker.url in str(refused.value)
    assert threads_since(before) == []


def test_leadership_stops_campaigning_when_its_acquires_are_refused(
    tmp_path: pathlib.Path, key: str
) -> None:
    auth = tmp_path / "auth.toml"
    auth.write_text('[[tokens]]\nname = "reader"\ntoken = "%s"\nprefixes = [""]\n'
                    'permissions = ["read"]\n' % SECRET)
    broker = BrokerProcess(None, ("--auth-file", str(auth)))
    try:
        with Broker(broker.url, token=SECRET) as client:
            # It may look (the constructor's inspect), not lock: the campaign stops, once.
            with Leadership(client, key, "node-a", ttl=2) as leadership:
                error = wait_until(lambda: leadership.error, 10, "the campaign to stop")
                assert error.status == 403 and not leadership.is_leader()
                assert not leadership._campaigner.is_alive()
    finally:
        broker.close()


def test_a_refusal_names_the_key_the_url_and_the_status(auth_broker: BrokerProcess) -> None:
    with Broker(auth_broker.url, token=SECRET) as client:
        with pytest.raises(BrokerError) as refused:
            client.acquire("elsewhere", ttl=10)
        message = str(refused.value)
        assert "'elsewhere'" in message and auth_broker.url in message and "403" in message
        assert SECRET not in message


@embedded_only
@pytest.mark.parametrize("status", [500, 501, 505])
def test_a_5xx_the_broker_never_sends_is_an_error_at_once(
    broker: BrokerProcess, key: str, status: int
) -> None:
    proxy = Proxy(broker.url)
    proxy.refuse = lambda exchange: status
    try:
        with Broker(proxy.url) as client:
            started = time.monotonic()
            with pytest.raises(BrokerError) as refused:
                client.acquire(key, ttl=10, wait=5)
            assert time.monotonic() - started < 1.0
            assert not isinstance(refused.value, Unavailable)
            assert refused.value.status == status
            assert str(status) in str(refused.value) and key in str(refused.value)
            assert proxy.url in str(refused.value)
            assert len(proxy.exchanges) == 1
    finally:
        proxy.close()


@embedded_only
# 502/503/504 are test_faults' (a load balancer's, a Redis outage's); 429 is new.
@pytest.mark.parametrize("status", [429])
def test_a_429_is_retried_with_the_same_request_id(
    broker: BrokerProcess, key: str, status: int
) -> None:
    proxy = Proxy(broker.url)
    refusals: List[int] = []

    def refuse_twice(exchange) -> Optional[int]:
        if len(refusals) < 2:
            refusals.append(status)
            return status
        return None

    proxy.refuse = refuse_twice
    try:
        with Broker(proxy.url) as client:
            lease = client.acquire(key, ttl=10, wait=5)
            posts = proxy.seen(lambda e: e.method == "POST")
            assert [e.status for e in posts] == [status, status, 201]
            assert len({e.json()["request_id"] for e in posts}) == 1
            lease.release()
            proxy.refuse = lambda exchange: status
            with pytest.raises(Unavailable):
                client.acquire(key, ttl=10, wait=0.3)
    finally:
        proxy.close()


@embedded_only
def test_the_trouble_hook_hears_failing_renewals_and_their_recovery(
    broker: BrokerProcess, key: str
) -> None:
    proxy = Proxy(broker.url)
    troubles: List[Optional[str]] = []
    heard = threading.Event()

    def on_trouble(trouble: Optional[str]) -> None:
        troubles.append(trouble)
        heard.set()

    try:
        with Broker(proxy.url) as client:
            lease = client.acquire(key, ttl=3.0, on_trouble=on_trouble)
            proxy.refuse = lambda e: 503 if e.path.endswith("/renew") else None
            assert heard.wait(3.0)
            heard.clear()
            proxy.refuse = lambda e: None
            assert heard.wait(3.0)
            assert lease.held
            assert len(troubles) == 2 and troubles[1] is None
            assert troubles[0] is not None and key in troubles[0] and "503" in troubles[0]
    finally:
        proxy.close()


def test_from_env_reads_the_url_and_the_auth_token_not_the_lock_token(
    auth_broker: BrokerProcess, key: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LOCKBROKER_URL", auth_broker.url)
    monkeypatch.setenv("LOCKBROKER_TOKEN", SECRET)  # what `lockbroker run` sets: not read
    monkeypatch.delenv("LOCKBROKER_AUTH_TOKEN", raising=False)
    with Broker.from_env() as client:
        assert client.url == auth_broker.url
        with pytest.raises(BrokerError) as refused:
            client.acquire(key, ttl=10)
        assert refused.value.status == 401
    monkeypatch.setenv("LOCKBROKER_AUTH_TOKEN", SECRET)
    with Broker.from_env(timeout=5) as client:
        client.acquire(key, ttl=10).release()
    monkeypatch.delenv("LOCKBROKER_URL")
    with Broker.from_env() as client:
        assert client.url == "http://127.0.0.1:8080"


@embedded_only
def test_with_lease_runs_the_work_under_the_lease_and_releases(broker: BrokerProcess, key: str) -> None:
    with Broker(broker.url) as client:
        def work(lease) -> int:
            assert lease.held
            assert [h["fence"] for h in broker.holders(key)] == [lease.fence]
            return lease.fence

        fence = client.with_lease(key, 10, 0, work)
        assert isinstance(fence, int) and broker.holders(key) == []
        with pytest.raises(RuntimeError):
            client.with_lease(key, 10, 0, lambda lease: (_ for _ in ()).throw(RuntimeError("x")))
        assert broker.holders(key) == []


def test_inspect_list_and_force_release(broker: BrokerProcess, key: str) -> None:
    with Broker(broker.url) as client:
        assert not client.inspect(key).held
        # Renewed every 0.5 s: the force release is seen within that.
        leases = [client.acquire(f"{key}-{i}", ttl=1.5, owner=f"o{i}") for i in range(3)]
        view = client.inspect(f"{key}-1")
        assert view.held and view.fence == leases[1].fence and view.owner == "o1"
        first = client.list(f"{key}-", limit=2)
        assert len(first.locks) == 2 and first.next_cursor is not None
        rest = client.list(f"{key}-", limit=2, cursor=first.next_cursor)
        assert sorted(v.key for v in first.locks + rest.locks) == [f"{key}-{i}" for i in range(3)]
        assert rest.next_cursor is None
        lost = lost_signal(leases[0])
        assert client.force_release(f"{key}-0") is True
        assert client.force_release(f"{key}-0") is False
        assert lost.wait(5) and leases[0].lost_reason == "not_held"
        with pytest.raises(ValueError):
            client.inspect("")
