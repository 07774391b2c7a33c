"""Sessions, sync and asyncio, against a real broker: leases kept past three session ttls by the
one keep-alive alone, the keys of a killed node going to waiters within the ttl and a second,
close releasing everything at once, a session ended at the broker lost with all its leases, the
lock delay after an expiry only, the secret never shown, and cancellation leaving nothing
behind (a waiting session acquire, a grant arriving after the cancellation, an open whose
answer came after it)."""

import asyncio
import json
import logging
import os
import pathlib
import select
import signal
import subprocess
import sys
import threading
import time
from typing import Any, Dict, List, Optional

import pytest

from conftest import Spawner, embedded_only
from harness import BrokerProcess, Exchange, Proxy, lost_signal, threads_since, wait_until
from lockbroker import Broker, BrokerError
from lockbroker.aio import AsyncBroker, AsyncSession

SRC = pathlib.Path(__file__).resolve().parents[1] / "src"


def keep_alives(exchange: Exchange) -> bool:
    return exchange.method == "POST" and exchange.path.startswith("/sessions/") and \
        exchange.path.endswith("/renew")


def lease_renewals(exchange: Exchange) -> bool:
    return exchange.method == "POST" and exchange.path.endswith("/renew") and \
        not exchange.path.startswith("/sessions/")


def secret(session: Any) -> str:
    """The session's secret, which only the test reads (to ask the broker about it)."""
    return session._id


# -- a node that dies -------------------------------------------------------------------------

NODE = r"""
import asyncio, json, sys
from lockbroker import Broker
from lockbroker.aio import AsyncBroker

url, keys, ttl, delay, mode = sys.argv[1], sys.argv[2].split(","), float(sys.argv[3]), \
    float(sys.argv[4]), sys.argv[5]

def report(session, leases):
    print(json.dumps({"session": session._id, "fences": [l.fence for l in leases]}), flush=True)
    sys.stdin.read()  # until killed

if mode == "sync":
    session = Broker(url).open_session(ttl, delay)
    report(session, [session.acquire(key) for key in keys])
else:
    async def main():
        session = await AsyncBroker(url).open_session(ttl, delay)
        leases = [await session.acquire(key) for key in keys]
        await asyncio.get_running_loop().run_in_executor(None, report, session, leases)
    asyncio.run(main())
"""


class Node:
    """Another process holding ``keys`` under a session of its own, kept alive by the client
    (sync, or a task on an asyncio loop) until :meth:`kill`: a node that dies, its keep-alive
    stopping with it."""

    def __init__(self, url: str, keys: List[str], ttl: float, lock_delay: float = 0.0,
                 mode: str = "sync") -> None:
        env = dict(os.environ, PYTHONPATH=str(SRC))
        self.proc = subprocess.Popen(
            [sys.executable, "-c", NODE, url, ",".join(keys), str(ttl), str(lock_delay), mode],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
        ready, _, _ = select.select([self.proc.stdout], [], [], 10)
        assert ready, "the node did not report its session"
        report = json.loads(self.proc.stdout.readline())
        self.session: str = report["session"]
        self.fences: List[int] = report["fences"]

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()


@pytest.fixture
def nodes() -> Any:
    started: List[Node] = []

    def start(*args: Any, **kwargs: Any) -> Node:
        node = Node(*args, **kwargs)
        started.append(node)
        return node

    yield start
    for node in started:
        node.kill()


def final_end_ms(broker: BrokerProcess, session: str) -> int:
    """The end of a session no longer kept alive, on the broker's store clock: what it shows
    until the session has ended (then ``404``)."""
    end = None
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        status, body = broker.call("GET", f"/sessions/{session}")
        if status == 404:
            assert end is not None, "the session had ended before it could be read"
            return end
        assert status == 200, (status, body)
        end = body["expires_at_ms"]
        time.sleep(0.02)
    raise AssertionError("the session did not end")


def granted_at_ms(lease: Any, ttl: float) -> float:
    """When a lease taken with ``ttl`` (and not renewed since) was granted, on the broker's
    store clock."""
    assert lease.expires_at is not None
    return lease.expires_at * 1000 - ttl * 1000


# -- sync -------------------------------------------------------------------------------------

def test_leases_under_a_session_live_past_three_ttls_on_keep_alives_alone(
    broker: BrokerProcess, key: str
) -> None:
    proxy = Proxy(broker.url)
    try:
        with Broker(proxy.url) as client:
            with client.open_session(ttl=1.0) as session:
                leases = [session.acquire(f"{key}-lock"),
                          session.acquire(f"{key}-shared", shared=True),
                          session.acquire_permit(f"{key}-permit", 2)]
                assert [lease.mode for lease in leases] == ["exclusive", "shared", "permit"]
                time.sleep(3.5)  # the span under test: three and a half session ttls
                assert session.alive and all(lease.held for lease in leases)
                for lease, space in zip(leases, ["locks", "locks", "semaphores"]):
                    holders = broker.holders(lease.key, space)
                    assert [h["fence"] for h in holders] == [lease.fence]
                    assert holders[0].get("session") is True
                # One request per keep-alive for all of them, and no lease renewed on its own.
                assert len(proxy.seen(keep_alives)) >= 3
                assert proxy.seen(lease_renewals) == []
            assert not session.alive and not any(lease.held for lease in leases)
        assert broker.holders(f"{key}-lock") == []
        assert broker.holders(f"{key}-permit", "semaphores") == []
    finally:
        proxy.close()


@pytest.mark.parametrize("mode", ["sync", "aio"])
def test_the_keys_of_a_killed_node_go_to_waiters_within_the_ttl_and_a_second(
    broker: BrokerProcess, key: str, nodes: Any, mode: str
) -> None:
    ttl = 2.0
    keys = [f"{key}-a", f"{key}-b"]
    node = nodes(broker.url, keys, ttl, mode=mode)
    waiters_before = broker.metric("lockbroker_waiters")
    results: Dict[str, Any] = {}
    with Broker(broker.url) as other:
        def wait_for(k: str) -> None:
            results[k] = other.acquire(k, ttl=30, wait=ttl + 5)

        threads = [threading.Thread(target=wait_for, args=(k,)) for k in keys]
        for thread in threads:
            thread.start()
        wait_until(lambda: broker.metric("lockbroker_waiters") >= waiters_before + 2, 10,
                   "both waiters to queue")
        node.kill()
        killed = time.monotonic()
        end = final_end_ms(broker, node.session)  # the last keep-alive's, plus the ttl
        for thread in threads:
            thread.join(ttl + 6)
        assert time.monotonic() - killed < ttl + 1.0
        for k, fence in zip(keys, node.fences):
            lease = results[k]
            assert lease.held and lease.fence > fence
            assert granted_at_ms(lease, 30) <= end + 1000
            lease.release()


def test_close_releases_every_lease_at_once(broker: BrokerProcess, key: str) -> None:
    with Broker(broker.url) as client, Broker(broker.url) as other:
        session = client.open_session(ttl=10)
        leases = [session.acquire(f"{key}-lock"), session.acquire(f"{key}-shared", shared=True),
                  session.acquire_permit(f"{key}-permit", 1)]
        lost = [lost_signal(session)] + [lost_signal(lease) for lease in leases]
        assert session.try_acquire(f"{key}-lock") is None  # not reentrant: held is held
        assert other.try_acquire(f"{key}-lock") is None
        session.close()
        assert not session.alive and not any(lease.held for lease in leases)
        # At once, without waiting: every key is free.
        taken = [other.try_acquire(f"{key}-lock"), other.try_acquire(f"{key}-shared"),
                 other.try_acquire_permit(f"{key}-permit", 1)]
        assert all(lease is not None for lease in taken)
        assert broker.call("GET", f"/sessions/{secret(session)}")[0] == 404
        assert not any(event.is_set() for event in lost)  # closing is not losing
        session.close()  # idempotent
        with pytest.raises(BrokerError) as refused:
            session.acquire(f"{key}-other")
        assert refused.value.code == "closed"


def test_releasing_one_lease_leaves_the_session_and_the_others(broker: BrokerProcess, key: str) -> None:
    with Broker(broker.url) as client:
        with client.open_session(ttl=10) as session:
            first, second = session.acquire(f"{key}-1"), session.acquire(f"{key}-2")
            first.release()
            assert session.alive and second.held and not first.held
            assert session.leases == [second]
            assert broker.holders(f"{key}-1") == [] and broker.holders(f"{key}-2") != []
            assert second.renew() is True  # it still stands (answered with the session's end)


@embedded_only
def test_a_session_ended_at_the_broker_is_lost_with_all_its_leases(
    broker: BrokerProcess, key: str
) -> None:
    with Broker(broker.url) as client:
        session = client.open_session(ttl=1.5)
        leases = [session.acquire(f"{key}-{i}") for i in range(3)]
        order: List[str] = []
        done = threading.Event()
        session.on_lost(lambda: order.append("session"))
        for lease in leases:
            lease.on_lost(lambda lease: order.append(lease.key))
        leases[-1].on_lost(done.set)
        assert broker.call("DELETE", f"/sessions/{secret(session)}")[0] == 204
        assert done.wait(1.5), "the next keep-alive (within a third of the ttl) sees it"
        assert order == ["session"] + [lease.key for lease in leases]
        assert not session.alive and session.lost_reason == "not_held"
        assert [lease.lost_reason for lease in leases] == ["not_held"] * 3
        later: List[bool] = []
        session.on_lost(lambda: later.append(True))  # after the loss: at once
        assert later == [True]
        session.close()  # quiet

        # Ended at the broker, not yet seen by a keep-alive: the acquire says so, and the
        # session is lost at once.
        quiet = client.open_session(ttl=30)
        fired = lost_signal(quiet)
        broker.call("DELETE", f"/sessions/{secret(quiet)}")
        with pytest.raises(BrokerError) as refused:
            quiet.acquire(key)
        assert (refused.value.status, refused.value.code) == (404, "no_session")
        assert fired.is_set() and not quiet.alive


def test_lock_delay_holds_the_keys_of_an_expired_session_only(
    broker: BrokerProcess, key: str, nodes: Any
) -> None:
    delay, ttl = 1.5, 1.0
    with Broker(broker.url) as client, Broker(broker.url) as other:
        # A clean close: no delay.
        with client.open_session(ttl=ttl, lock_delay=delay) as session:
            assert session.lock_delay == delay
            status, body = broker.call("GET", f"/sessions/{secret(session)}")
            assert status == 200 and body["lock_delay_ms"] == 1500
            session.acquire(key)
        assert other.try_acquire(key, ttl=10) is not None

        # An expiry: nobody gets the key for the delay after the session's end.
        dead = f"{key}-expired"
        node = nodes(broker.url, [dead], ttl, lock_delay=delay)
        waiters_before = broker.metric("lockbroker_waiters")
        result: Dict[str, Any] = {}
        waiter = threading.Thread(
            target=lambda: result.setdefault("lease", other.acquire(dead, ttl=30, wait=10)))
        waiter.start()
        wait_until(lambda: broker.metric("lockbroker_waiters") > waiters_before, 10,
                   "the waiter to queue")
        node.kill()
        end = final_end_ms(broker, node.session)
        assert other.try_acquire(dead, ttl=30) is None  # inside the delay (and a waiter first)
        waiter.join(15)
        granted = granted_at_ms(result["lease"], 30)
        assert end + delay * 1000 - 5 <= granted <= end + delay * 1000 + 1000


@embedded_only
def test_the_session_secret_is_never_shown(
    broker: BrokerProcess, key: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="lockbroker")
    shown: List[str] = []
    with Broker(broker.url) as client:
        session = client.open_session(ttl=1.0, owner="node-7")
        lease = session.acquire(key)
        shown += [repr(session), str(session), repr(lease), repr(client)]
        shown.append(json.dumps(broker.call("GET", f"/locks/{key}")[1]))
        shown.append(json.dumps(broker.call("GET", "/locks")[1]))
        with pytest.raises(BrokerError) as held:
            client.open_session(ttl=1.0).acquire(key)
        shown.append(str(held.value))
        fired = lost_signal(session)
        broker.call("DELETE", f"/sessions/{secret(session)}")
        assert fired.wait(2)
        with pytest.raises(BrokerError) as ended:
            session.acquire(key)
        shown += [str(ended.value), repr(session), repr(lease)]
        session.close()
    shown += [record.getMessage() for record in caplog.records]
    assert any("session" in line and "lost" in line for line in shown)  # the loss is logged
    assert not [line for line in shown if secret(session) in line]


@embedded_only
def test_one_thread_keeps_every_session_and_lease_of_a_broker(broker: BrokerProcess, key: str) -> None:
    before = set(threading.enumerate())
    with Broker(broker.url) as client:
        sessions = [client.open_session(ttl=1.0) for _ in range(3)]
        leases = [s.acquire(f"{key}-{i}-{j}") for i, s in enumerate(sessions) for j in range(5)]
        plain = client.acquire(f"{key}-plain", ttl=1.0)
        first = [s.expires_at for s in sessions]
        wait_until(lambda: all(s.expires_at != e for s, e in zip(sessions, first)), 5,
                   "every session kept alive once")
        assert [t.name for t in threads_since(before)] == ["lockbroker-renewer"]
        assert all(s.alive for s in sessions) and all(lease.held for lease in leases)
        assert plain.held
    assert threads_since(before) == []
    assert not any(s.alive for s in sessions)
    assert broker.call("GET", f"/locks?prefix={key}-")[1]["locks"] == []


def test_keep_alives_answered_503_are_retried_and_the_session_kept(spawn: Spawner, key: str) -> None:
    broker = spawn.broker()
    proxy = spawn.proxy(broker)
    refusing = threading.Event()
    refusing.set()
    proxy.refuse = lambda e: 503 if keep_alives(e) and refusing.is_set() else None
    with Broker(proxy.url) as client:
        session = client.open_session(ttl=2.0)
        lease = session.acquire(key)
        fired = lost_signal(session)
        proxy.wait_for(keep_alives, 2)  # two refused: retried with backoff, not given up
        refusing.clear()
        wait_until(lambda: [e for e in proxy.seen(keep_alives) if e.status == 200], 2,
                   "a keep-alive to get through")
        assert session.alive and lease.held and not fired.is_set()
        session.close()


def test_close_never_raises_when_the_broker_is_gone(spawn: Spawner, key: str) -> None:
    broker = spawn.broker()
    with Broker(broker.url, timeout=0.5) as client:
        session = client.open_session(ttl=5)
        lease = session.acquire(key)
        broker.kill()
        started = time.monotonic()
        session.close()  # the leases end with the session's ttl
        assert time.monotonic() - started < 2
        assert not session.alive and not lease.held


def test_bad_session_arguments_are_refused_before_anything_is_sent() -> None:
    with Broker("http://127.0.0.1:9") as client:
        for ttl in (0, -1.0, float("inf")):
            with pytest.raises(ValueError):
                client.open_session(ttl=ttl)
        for delay in (-0.1, 61.0):
            with pytest.raises(ValueError):
                client.open_session(ttl=10, lock_delay=delay)
        with pytest.raises(TypeError):
            client.open_session(ttl="10")  # type: ignore[arg-type]


# -- asyncio ----------------------------------------------------------------------------------

@embedded_only
def test_async_session_keeps_its_leases_with_one_task_and_no_thread(
    broker: BrokerProcess, key: str
) -> None:
    async def scenario() -> None:
        before = set(threading.enumerate())
        async with AsyncBroker(broker.url) as client, AsyncBroker(broker.url) as other:
            async with await client.open_session(ttl=1.0) as session:
                assert isinstance(session, AsyncSession)
                leases = [await session.acquire(f"{key}-lock"),
                          await session.acquire(f"{key}-shared", shared=True),
                          await session.acquire_permit(f"{key}-permit", 1)]
                await asyncio.sleep(3.5)  # the span under test
                assert session.alive and all(lease.held for lease in leases)
                assert all(lease._task is None for lease in leases)  # not renewed one by one
                assert session._task is not None and not session._task.done()
                assert session._task.get_loop() is asyncio.get_running_loop()
                assert threads_since(before) == []
                assert await other.try_acquire(f"{key}-lock") is None
            # Closed on leaving the block: every key free at once.
            assert not any(lease.held for lease in leases)
            assert await other.try_acquire(f"{key}-lock") is not None
            assert await other.try_acquire_permit(f"{key}-permit", 1) is not None

    asyncio.run(scenario())


@embedded_only
def test_async_session_lost_runs_plain_and_coroutine_callbacks(
    broker: BrokerProcess, key: str
) -> None:
    async def scenario() -> None:
        async with AsyncBroker(broker.url) as client:
            session = await client.open_session(ttl=1.5)
            lease = await session.acquire(key)
            calls: List[str] = []
            done = asyncio.Event()

            async def coroutine_callback() -> None:
                calls.append("lease")
                done.set()

            session.on_lost(lambda: calls.append("session"))
            lease.on_lost(coroutine_callback)
            broker.call("DELETE", f"/sessions/{secret(session)}")
            await asyncio.wait_for(done.wait(), 1.5)
            assert calls == ["session", "lease"]
            assert not session.alive and not lease.held and lease.lost_reason == "not_held"
            await session.close()  # quiet
            with pytest.raises(BrokerError):
                await session.acquire(key)

    asyncio.run(scenario())


def test_async_session_acquire_cancelled_while_waiting_leaves_nothing_behind(
    broker: BrokerProcess, key: str
) -> None:
    async def scenario() -> None:
        async with AsyncBroker(broker.url) as client, AsyncBroker(broker.url) as other:
            holder = await other.acquire(key, ttl=10)
            session = await client.open_session(ttl=10)
            before = broker.metric("lockbroker_waiters")
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(session.acquire(key, wait=20), 0.5)
            deadline = time.monotonic() + 5
            while broker.metric("lockbroker_waiters") != before:
                assert time.monotonic() < deadline, "the cancelled waiter is still queued"
                await asyncio.sleep(0.02)
            await holder.release()
            assert broker.holders(key) == [] and session.leases == []
            assert session.alive

    asyncio.run(scenario())


def _hold_first(proxy: Proxy, method: str, path: str) -> "tuple[threading.Event, threading.Event]":
    """Makes the proxy hold back, then lose, the broker's answer to the first ``method path``:
    granted at the broker, unknown to the client."""
    granted, resume = threading.Event(), threading.Event()

    def hold(exchange: Exchange) -> bool:
        if exchange.method == method and exchange.path == path and not granted.is_set():
            granted.set()
            resume.wait(10)
            return True
        return False

    proxy.drop = hold
    return granted, resume


def test_async_session_grant_that_arrives_after_the_cancellation_is_released(
    broker: BrokerProcess, key: str
) -> None:
    proxy = Proxy(broker.url)
    granted, resume = _hold_first(proxy, "POST", f"/locks/{key}")

    async def scenario() -> None:
        async with AsyncBroker(proxy.url) as client:
            session = await client.open_session(ttl=30)
            acquire = asyncio.ensure_future(session.acquire(key, wait=5))
            while not granted.is_set():
                await asyncio.sleep(0.01)
            assert broker.holders(key) != []
            acquire.cancel()
            with pytest.raises(asyncio.CancelledError):
                await acquire
            assert broker.holders(key) == []  # released before the cancellation went on
            assert session.alive and session.leases == []
            resume.set()

    try:
        asyncio.run(scenario())
        posts = proxy.seen(lambda e: e.method == "POST" and e.path == f"/locks/{key}")
        assert len(posts) == 2 and posts[0].json()["request_id"] == posts[1].json()["request_id"]
        assert [e.status for e in proxy.seen(lambda e: e.method == "DELETE" and
                                             e.path == f"/locks/{key}")] == [204]
    finally:
        resume.set()
        proxy.close()


def test_async_open_session_cancelled_after_its_grant_closes_the_session(
    broker: BrokerProcess,
) -> None:
    proxy = Proxy(broker.url)
    granted, resume = _hold_first(proxy, "POST", "/sessions")

    async def scenario() -> None:
        async with AsyncBroker(proxy.url) as client:
            opening = asyncio.ensure_future(client.open_session(ttl=30))
            while not granted.is_set():
                await asyncio.sleep(0.01)
            opening.cancel()
            with pytest.raises(asyncio.CancelledError):
                await opening
            resume.set()

    try:
        asyncio.run(scenario())
        opened = proxy.wait_for(lambda e: e.method == "POST" and e.path == "/sessions", 2)
        assert opened[0].json()["request_id"] == opened[1].json()["request_id"]
        session = opened[0].answer["session"]
        assert opened[1].answer["session"] == session  # the same session, found again
        assert broker.call("GET", f"/sessions/{session}")[0] == 404  # closed
        assert [e.status for e in proxy.seen(lambda e: e.method == "DELETE")] == [204]
    finally:
        resume.set()
        proxy.close()


def test_leaving_an_async_broker_closes_its_sessions(broker: BrokerProcess, key: str) -> None:
    async def scenario() -> Optional[str]:
        async with AsyncBroker(broker.url) as client:
            session = await client.open_session(ttl=10)
            await session.acquire(key)
        assert not session.alive
        return secret(session)

    session = asyncio.run(scenario())
    assert broker.call("GET", f"/sessions/{session}")[0] == 404
    assert broker.holders(key) == []
