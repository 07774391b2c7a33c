package io.lockbroker.client.tests;

import static io.lockbroker.client.tests.ClientTests.async;
import static io.lockbroker.client.tests.ClientTests.check;
import static io.lockbroker.client.tests.ClientTests.equal;
import static io.lockbroker.client.tests.ClientTests.fenceOf;
import static io.lockbroker.client.tests.ClientTests.get;
import static io.lockbroker.client.tests.ClientTests.requestId;
import static io.lockbroker.client.tests.ClientTests.send;

import io.lockbroker.client.Lease;
import io.lockbroker.client.LeaseLostException;
import io.lockbroker.client.LockBroker;
import io.lockbroker.client.LockedException;
import io.lockbroker.client.Session;
import java.time.Duration;
import java.util.ArrayList;
import java.util.List;
import java.util.concurrent.CompletableFuture;
import java.util.concurrent.TimeUnit;
import java.util.concurrent.atomic.AtomicInteger;
import java.util.stream.Collectors;

/**
 * Several keys at once ({@code acquireAll}): every key or none, a fence per key, two callers in
 * opposite orders both served, one key lost loses the lease (the others released), one release
 * for all, and the same under a session.
 */
final class SeveralKeysTests {
    private SeveralKeysTests() {
    }

    /** One busy key: nothing held, the busy key named; once free, all held, each with its fence. */
    static void allOrNothingWithAFenceEach(ClientTests.Env env) throws Exception {
        try (LockBroker broker = LockBroker.create(env.url()); LockBroker other = LockBroker.create(env.url())) {
            List<String> keys = List.of(env.key("all-a"), env.key("all-b"), env.key("all-c"));
            Lease busy = other.acquire(keys.get(1), Duration.ofSeconds(10), Duration.ZERO);
            try {
                broker.acquireAll(keys, Duration.ofSeconds(10), Duration.ofMillis(300));
                throw new AssertionError("acquired every key while one was held");
            } catch (LockedException e) {
                equal(List.of(keys.get(1)), e.heldKeys(), "the busy key is named");
                equal(409, e.status(), "status");
                check(e.getMessage().contains(keys.get(1)), "the message names it: " + e.getMessage());
            }
            equal(404, get(env.url() + "/locks/" + keys.get(0)).statusCode(), "the first key is not held");
            equal(404, get(env.url() + "/locks/" + keys.get(2)).statusCode(), "nor the last");
            CompletableFuture<Lease> waiting = async(() -> broker.acquireAll(keys, Duration.ofSeconds(10),
                    Duration.ofSeconds(20)));
            busy.release();
            Lease all = waiting.get(15, TimeUnit.SECONDS);
            check(all.isHeld(), "held once the busy key was released");
            equal(keys, all.keys(), "every key, in order");
            equal(keys.get(0), all.key(), "key() is the first key");
            equal(all.fence(keys.get(0)), all.fence(), "fence() is the first key's");
            for (String key : keys) {
                equal(all.fence(key), fenceOf(get(env.url() + "/locks/" + key).body()), "the broker's fence of " + key);
            }
            check(all.fence(keys.get(1)) > busy.fence(), "the busy key's fence rose");
            check(!all.toString().contains("token"), "no token shown: " + all);
            try {
                all.fence("java-not-one-of-them");
                throw new AssertionError("a fence for a key the lease does not hold");
            } catch (IllegalArgumentException e) {
                check(e.getMessage().contains("java-not-one-of-them"), "names the key: " + e.getMessage());
            }
            all.release();
            for (String bad : List.of("[]", "dup", "bad key")) {
                List<String> list = bad.equals("[]") ? List.of() : bad.equals("dup") ? List.of("x", "x") : List.of("a b");
                try {
                    broker.acquireAll(list, Duration.ofSeconds(10), Duration.ZERO);
                    throw new AssertionError("acquired " + list);
                } catch (IllegalArgumentException e) {
                    check(!e.getMessage().isEmpty(), "a clear error for " + bad);
                }
            }
        }
    }

    /** Granted at the broker, told 503: the retry keeps the request_id and gets the one grant back. */
    static void retryKeepsRequestId(ClientTests.Env env) throws Exception {
        try (RecordingProxy proxy = new RecordingProxy(env.url());
                LockBroker broker = LockBroker.create(proxy.url())) {
            List<String> keys = List.of(env.key("retry-a"), env.key("retry-b"));
            proxy.fault(c -> c.isAcquire() && c.path.equals("/locks"), RecordingProxy.Fault.FORWARD_THEN_503, 1);
            Lease both = broker.acquireAll(keys, Duration.ofSeconds(10), Duration.ofSeconds(5));
            List<RecordingProxy.Call> posts = proxy.calls().stream()
                    .filter(c -> c.isAcquire() && c.path.equals("/locks")).collect(Collectors.toList());
            equal(2, posts.size(), "one retry: " + posts);
            equal(201, posts.get(0).upstreamStatus, "the first request was granted at the broker");
            equal(requestId(posts.get(0).body), requestId(posts.get(1).body), "the retry kept the request_id");
            check(posts.get(0).upstreamBody.contains("\"fence\":" + both.fence(keys.get(1))),
                    "the lease returned is the first grant: " + posts.get(0).upstreamBody);
            for (String key : keys) {
                equal(both.fence(key), fenceOf(get(env.url() + "/locks/" + key).body()), "the broker holds " + key);
            }
            both.release();
            for (String key : keys) {
                equal(404, get(env.url() + "/locks/" + key).statusCode(), key + " released");
            }
        }
    }

    /** Eight callers take {a, b} in opposite orders, 5 times each: every one served, never two at once. */
    static void oppositeOrdersAllComplete(ClientTests.Env env) throws Exception {
        String a = env.key("order-a");
        String b = env.key("order-b");
        AtomicInteger inside = new AtomicInteger();
        AtomicInteger served = new AtomicInteger();
        List<LockBroker> clients = new ArrayList<>();
        List<CompletableFuture<Void>> runs = new ArrayList<>();
        try {
            for (int i = 0; i < 8; i++) {
                LockBroker client = LockBroker.create(env.url());
                clients.add(client);
                List<String> keys = i % 2 == 0 ? List.of(a, b) : List.of(b, a);
                runs.add(async(() -> {
                    for (int n = 0; n < 5; n++) {
                        try (Lease both = client.acquireAll(keys, Duration.ofSeconds(10), Duration.ofSeconds(30))) {
                            check(inside.incrementAndGet() == 1, "nobody else holds either key meanwhile");
                            check(both.isHeld(), "held");
                            inside.decrementAndGet();
                        }
                        served.incrementAndGet();
                    }
                    return null;
                }));
            }
            CompletableFuture.allOf(runs.toArray(new CompletableFuture<?>[0])).get(60, TimeUnit.SECONDS);
            equal(40, served.get(), "every acquisition served");
        } finally {
            for (LockBroker client : clients) {
                client.close();
            }
        }
    }

    /** Renewed key by key; one key force-released: the lease is lost once, and the other key released. */
    static void lostKeyLosesTheLease(ClientTests.Env env) throws Exception {
        try (LockBroker broker = LockBroker.create(env.url()); LockBroker other = LockBroker.create(env.url())) {
            String a = env.key("lost-a");
            String b = env.key("lost-b");
            Duration ttl = Duration.ofMillis(1000);
            Lease both = broker.acquireAll(List.of(a, b), ttl, Duration.ZERO);
            long end = System.nanoTime() + TimeUnit.MILLISECONDS.toNanos(2500);
            while (System.nanoTime() < end) { // 2.5 ttls: held by the renewals of both keys
                check(both.isHeld(), "held throughout");
                Thread.sleep(100);
            }
            check(other.tryAcquire(b, ttl).isEmpty(), "the second key is still held after 2.5 ttls");
            AtomicInteger calls = new AtomicInteger();
            CompletableFuture<Void> lost = new CompletableFuture<>();
            both.onLost(() -> {
                calls.incrementAndGet();
                lost.complete(null);
            });
            equal(204, send("DELETE", env.url() + "/locks/" + b + "?force=true").statusCode(), "force release of b");
            lost.get(ttl.toMillis(), TimeUnit.MILLISECONDS);
            check(!both.isHeld(), "not held once lost");
            check(both.lostReason().orElse("").contains(b), "the reason names the lost key: " + both.lostReason());
            Lease next = other.acquire(a, ttl, Duration.ofSeconds(5)); // the client releases a
            check(next.fence() > both.fence(), "a was released and taken by the next");
            next.release();
            both.release();
            equal(1, calls.get(), "the callback ran once");
        }
    }

    /** release() releases every key with one DELETE /locks?keys=; close() of the client does too. */
    static void releaseReleasesAll(ClientTests.Env env) throws Exception {
        try (RecordingProxy proxy = new RecordingProxy(env.url())) {
            LockBroker broker = LockBroker.create(proxy.url());
            List<String> keys = List.of(env.key("rel-a"), env.key("rel-b"));
            Lease both = broker.acquireAll(keys, Duration.ofSeconds(10), Duration.ZERO);
            both.release();
            check(!both.isHeld(), "released");
            for (String key : keys) {
                equal(404, get(env.url() + "/locks/" + key).statusCode(), key + " released at the broker");
            }
            List<String> deletes = new ArrayList<>();
            for (RecordingProxy.Call c : proxy.calls()) {
                if ("DELETE".equals(c.method)) {
                    deletes.add(c.path);
                }
            }
            equal(List.of("/locks?keys=" + String.join(",", keys)), deletes, "one DELETE for every key");
            both.release();
            Lease again = broker.acquireAll(keys, Duration.ofSeconds(10), Duration.ZERO);
            broker.close();
            for (String key : keys) {
                equal(404, get(env.url() + "/locks/" + key).statusCode(), key + " released when the client closed");
            }
            check(!again.isHeld(), "not held after close");
        }
    }

    /** Under a session: no ttl sent, held on the keep-alive, release() releases all, close() too. */
    static void underASession(ClientTests.Env env) throws Exception {
        try (RecordingProxy proxy = new RecordingProxy(env.url());
                LockBroker broker = LockBroker.create(proxy.url());
                LockBroker other = LockBroker.create(env.url())) {
            List<String> keys = List.of(env.key("s-all-a"), env.key("s-all-b"));
            Session session = broker.openSession(Duration.ofMillis(1000));
            Lease both = session.acquireAll(keys, Duration.ZERO);
            for (RecordingProxy.Call c : proxy.calls()) {
                if (c.isAcquire() && c.path.equals("/locks")) {
                    check(c.body.contains("\"session\":") && !c.body.contains("ttl_ms"), "the session, no ttl: " + c.body);
                }
            }
            long end = System.nanoTime() + TimeUnit.MILLISECONDS.toNanos(2500);
            while (System.nanoTime() < end) {
                check(both.isHeld(), "held on the session's keep-alive");
                Thread.sleep(100);
            }
            for (RecordingProxy.Call c : proxy.calls()) {
                check(!c.isRenew() || c.path.startsWith("/sessions/"), "no renewal of its own: " + c);
            }
            for (String key : keys) {
                equal(both.fence(key), fenceOf(get(env.url() + "/locks/" + key).body()), key + " held at the broker");
            }
            both.release();
            for (String key : keys) {
                equal(404, get(env.url() + "/locks/" + key).statusCode(), key + " released");
            }
            check(session.isAlive(), "the session goes on");
            Lease again = session.acquireAll(keys, Duration.ZERO);
            try {
                other.acquireAll(keys, Duration.ofSeconds(5), Duration.ZERO);
                throw new AssertionError("took keys held under a session");
            } catch (LockedException e) {
                equal(keys, e.heldKeys(), "both busy");
            }
            session.close();
            check(!again.isHeld(), "closed with the session");
            for (String key : keys) {
                equal(404, get(env.url() + "/locks/" + key).statusCode(), key + " released with the session");
            }
            // One key force-released: the lease's renew() sees it; the lease is lost, the other key released.
            Session second = broker.openSession(Duration.ofSeconds(10));
            Lease third = second.acquireAll(keys, Duration.ZERO);
            check(other.forceRelease(keys.get(1)), "force-released");
            try {
                third.renew();
                throw new AssertionError("renewed a lease one of whose keys was force-released");
            } catch (LeaseLostException e) {
                check(e.getMessage().contains(keys.get(1)), "names the key: " + e.getMessage());
            }
            check(!third.isHeld() && second.isAlive(), "the lease is lost, the session goes on");
            Lease next = other.acquire(keys.get(0), Duration.ofSeconds(5), Duration.ofSeconds(5));
            check(next.fence() > third.fence(), "the other key was released and taken by the next");
            next.release();
            second.close();
        }
    }
}
