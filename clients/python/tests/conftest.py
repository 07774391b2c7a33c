"""Fixtures: brokers on the embedded store and on a real Redis (``store`` is parametrized over
both), shared by a module's tests where a test leaves nothing behind, and one of the test's own
where it stops, pauses or restarts something."""

import pathlib
import sys
import uuid
from typing import Iterator, List

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from harness import BrokerProcess, Proxy, RedisServer  # noqa: E402

STORES = ["embedded", "redis"]

#: For a test of the client's own logic, which the store behind the broker does not change: the
#: shared broker on the embedded store only.
embedded_only = pytest.mark.parametrize("broker", ["embedded"], indirect=True)


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    server = RedisServer()
    yield server
    server.close()


@pytest.fixture(scope="session", params=STORES)
def broker(request: pytest.FixtureRequest) -> Iterator[BrokerProcess]:
    """A broker shared by the tests that leave it as they found it (each on keys of its own)."""
    redis_url = None
    if request.param == "redis":
        redis_url = request.getfixturevalue("redis_server").url
    process = BrokerProcess(redis_url)
    yield process
    process.close()


class Spawner:
    """Starts brokers (and Redis servers) that belong to one test, and stops them after it."""

    def __init__(self, store: str) -> None:
        self.store = store
        self._brokers: List[BrokerProcess] = []
        self._redis: List[RedisServer] = []
        self._proxies: List[Proxy] = []

    def redis(self) -> RedisServer:
        server = RedisServer()
        self._redis.append(server)
        return server

    def broker(self, *extra: str, redis: "RedisServer | None" = None) -> BrokerProcess:
        if self.store == "redis" and redis is None:
            redis = self.redis()
        process = BrokerProcess(redis.url if redis else None, tuple(extra))
        self._brokers.append(process)
        return process

    def proxy(self, broker: BrokerProcess) -> Proxy:
        proxy = Proxy(broker.url)
        self._proxies.append(proxy)
        return proxy

    def on_redis_behind_proxy(self) -> "tuple[RedisServer, BrokerProcess, Proxy]":
        """A Redis of the test's own, a broker on it, and a recording proxy in front."""
        redis = self.redis()
        broker = self.broker(redis=redis)
        return redis, broker, self.proxy(broker)

    def close(self) -> None:
        for proxy in self._proxies:
            proxy.close()
        for process in self._brokers:
            process.close()
        for server in self._redis:
            server.close()


@pytest.fixture(params=STORES)
def spawn(request: pytest.FixtureRequest) -> Iterator[Spawner]:
    spawner = Spawner(request.param)
    yield spawner
    spawner.close()


@pytest.fixture
def key() -> str:
    """A key no other test uses."""
    return f"py-{uuid.uuid4().hex[:12]}"


@pytest.fixture
def redis_spawn() -> Iterator[Spawner]:
    """As ``spawn``, for the tests of what a Redis outage does (Redis only)."""
    spawner = Spawner("redis")
    yield spawner
    spawner.close()
