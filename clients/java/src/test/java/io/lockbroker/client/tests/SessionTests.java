package io.lockbroker.client.tests;

import static io.lockbroker.client.tests.ClientTests.async;
import static io.lockbroker.client.tests.ClientTests.awaitMetric;
import static io.lockbroker.client.tests.ClientTests.check;
import static io.lockbroker.client.tests.ClientTests.equal;
import static io.lockbroker.client.tests.ClientTests.fenceOf;
import static io.lockbroker.client.tests.ClientTests.get;
import static io.lockbroker.client.tests.ClientTests.holders;
import static io.lockbroker.client.tests.ClientTests.metric;
import static io.lockbroker.client.tests.ClientTests.send;

import io.lockbroker.client.Lease;
import io.lockbroker.client.LeaseLostException;
import io.lockbroker.client.LockBroker;
import io.lockbroker.client.LockBrokerException;
import io.lockbroker.client.Session;
import java.net.http.HttpResponse;
import java.nio.file.Path;
import java.time.Duration;
import java.util.ArrayList;
import java.util.Arrays;
import java.util.Collections;
import java.util.List;
import java.util.concurrent.CompletableFuture;
import java.util.concurrent.TimeUnit;
import java.util.concurrent.atomic.AtomicInteger;
import java.util.function.Predicate;
import java.util.logging.Handler;
import java.util.logging.LogRecord;
import java.util.logging.Logger;
import java.util.regex.Matcher;
import java.util.regex.Pattern;

/**
 * Sessions: one keep-alive for many leases; leases that live on it alone; a node that dies
 * (a JVM of its own, killed) loses them all within the ttl; close releases at once; the lock
 * delay after an expiry only; a session lost by the client (keep-alives failing, or ended at the
 * broker) loses every lease under it; the secret never shown.
 */
final class SessionTests {
    private static final Predicate<RecordingProxy.Call> KEEP_ALIVE =
            c -> c.isRenew() && c.path.startsWith("/sessions/");

    private SessionTests() {
    }

    /** Leases (exclusive, shared, a permit) under a 1 s session live 3.5 s on its keep-alive alone. */
    static void leasesLivePastThreeTtls(ClientTests.Env env) throws Exception {
        try (RecordingProxy proxy = new RecordingProxy(env.url());
                LockBroker broker = LockBroker.create(proxy.url());
                LockBroker other = LockBroker.create(env.url())) {
            String key = env.key("s-live");
            String shared = env.key("s-shared");
            String sem = env.key("s-sem");
            Duration ttl = Duration.ofMillis(1000);
            Session session = broker.openSession(ttl);
            String secret = secretOf(proxy);
            check(session.isAlive(), "a fresh session is alive");
            equal(ttl, session.ttl(), "the session's ttl");
            Lease a = session.acquire(key, Duration.ZERO);
            Lease b = session.lock(shared).shared().acquire();
            Lease p = session.semaphore(sem, 2).acquire();
            for (RecordingProxy.Call c : proxy.calls()) {
                if (c.isAcquire() && !c.path.equals("/sessions")) {
                    check(c.body.contains("\"session\":\"" + secret + "\"") && !c.body.contains("ttl_ms"),
                            "an acquire under the session names it in its body, and no ttl");
                    check(!c.path.contains(secret), "nor in its URL");
                }
            }
            long end = System.nanoTime() + TimeUnit.MILLISECONDS.toNanos(3 * ttl.toMillis() + 500);
            while (System.nanoTime() < end) {
                check(session.isAlive() && a.isHeld() && b.isHeld() && p.isHeld(), "alive and held throughout");
                Thread.sleep(100);
            }
            check(other.tryAcquire(key, ttl).isEmpty(), "nobody else could take it after 3.5 ttls");
            check(other.tryAcquire(shared, ttl).isEmpty(), "no exclusive lease beside the shared one");
            String view = get(env.url() + "/locks/" + key).body();
            equal(a.fence(), fenceOf(view), "the same lease at the broker");
            check(view.matches("(?s).*\"session\"\\s*:\\s*true.*") && !view.contains(secret), "shown as a session lease: " + view);
            equal(p.fence(), broker.inspectSemaphore(sem).fence(), "the permit at the broker");
            HttpResponse<String> shown = get(env.url() + "/sessions/" + secret);
            equal(200, shown.statusCode(), "the session at the broker");
            equal(3, holders(shown.body()), "its three leases: " + shown.body());
            equal(0L, proxy.count(c -> c.isRenew() && !KEEP_ALIVE.test(c)), "no lease renewed by itself");
            long keepAlives = proxy.count(KEEP_ALIVE);
            check(keepAlives >= 3 && keepAlives <= 16, "one keep-alive a third of the ttl for all three: " + keepAlives);
            session.close();
            check(!session.isAlive() && !a.isHeld() && !b.isHeld() && !p.isHeld(), "closed, and its leases released");
            equal(404, get(env.url() + "/locks/" + key).statusCode(), "released at the broker");
            equal(404, get(env.url() + "/locks/" + shared).statusCode(), "the shared lease released at the broker");
            equal(0, broker.inspectSemaphore(sem).holders(), "the permit released at the broker");
            long closedAt = proxy.count(KEEP_ALIVE);
            Thread.sleep(1000); // three keep-alive periods: a keep-alive still running would have sent some
            equal(closedAt, proxy.count(KEEP_ALIVE), "no keep-alive after close");
        }
    }

    /** Closing the session releases its leases at once (a waiter gets the key), and is not a loss. */
    static void closeReleasesAtOnce(ClientTests.Env env) throws Exception {
        LockBroker broker = LockBroker.create(env.url()); // closed by the test
        try (LockBroker other = LockBroker.create(env.url())) {
            String k1 = env.key("s-close");
            String k2 = env.key("s-close");
            Session session = broker.openSession(Duration.ofSeconds(20));
            Lease a = session.acquire(k1, Duration.ZERO);
            Lease b = session.acquire(k2, Duration.ZERO);
            AtomicInteger lost = new AtomicInteger();
            session.onLost(lost::incrementAndGet);
            a.onLost(lost::incrementAndGet);
            b.onLost(lost::incrementAndGet);
            long waitersBefore = metric(env.url(), "lockbroker_waiters");
            CompletableFuture<Lease> waiter = async(() -> other.acquire(k1, Duration.ofSeconds(20), Duration.ofSeconds(20)));
            awaitMetric(env.url(), "lockbroker_waiters", waitersBefore + 1);
            long closed = System.nanoTime();
            session.close();
            check(!session.isAlive() && !a.isHeld() && !b.isHeld(), "closed, its leases released");
            Lease granted = waiter.get(10, TimeUnit.SECONDS);
            long ms = TimeUnit.NANOSECONDS.toMillis(System.nanoTime() - closed);
            check(ms < 2000, "the waiter got the key " + ms + " ms after the close, not at the session's end (20 s)");
            check(granted.fence() > a.fence(), "with a greater fence");
            other.tryAcquire(k2, Duration.ofSeconds(10)).orElseThrow(() -> new AssertionError("k2 still held")).release();
            check(session.lostReason().isEmpty(), "a close is not a loss");
            session.close(); // idempotent and quiet, as are the leases' releases
            a.release();
            b.close();
            try {
                session.acquire(k2, Duration.ZERO);
                throw new AssertionError("acquired under a closed session");
            } catch (IllegalStateException e) {
                check(e.getMessage().contains("closed"), e.getMessage());
            }
            granted.release();
            // Closing the client closes its sessions too.
            Session second = broker.openSession(Duration.ofSeconds(20));
            Lease c = second.acquire(k1, Duration.ZERO);
            broker.close();
            check(!second.isAlive() && !c.isHeld(), "closing the client closed its session");
            equal(404, get(env.url() + "/locks/" + k1).statusCode(), "and released its lease at the broker");
            equal(0, lost.get(), "no lost callback ran");
        } finally {
            broker.close();
        }
    }

    /**
     * A node (a JVM of its own) holds two keys under a 1.5 s session past its ttl; killed, its
     * keys go to the waiters on another client within ttl + 1 s of the kill.
     */
    static void abandonedSessionLeasesGoToWaiters(ClientTests.Env env) throws Exception {
        long ttlMs = 1500;
        String k1 = env.key("s-node");
        String k2 = env.key("s-node");
        try (LockBroker other = LockBroker.create(env.url()); Holder node = Holder.start(env.url(), ttlMs, 0, k1, k2)) {
            long waitersBefore = metric(env.url(), "lockbroker_waiters");
            CompletableFuture<Lease> w1 = async(() -> other.acquire(k1, Duration.ofSeconds(10), Duration.ofSeconds(20)));
            CompletableFuture<Lease> w2 = async(() -> other.acquire(k2, Duration.ofSeconds(10), Duration.ofSeconds(20)));
            CompletableFuture<Long> t1 = w1.thenApply(lease -> System.nanoTime());
            CompletableFuture<Long> t2 = w2.thenApply(lease -> System.nanoTime());
            awaitMetric(env.url(), "lockbroker_waiters", waitersBefore + 2);
            Thread.sleep(ttlMs + 500); // longer than the ttl: the node's keep-alives hold both keys
            check(!w1.isDone() && !w2.isDone(), "the node's keys were held past its session's ttl");
            long killed = System.nanoTime();
            node.kill();
            long after1 = TimeUnit.NANOSECONDS.toMillis(t1.get(ttlMs + 3000, TimeUnit.MILLISECONDS) - killed);
            long after2 = TimeUnit.NANOSECONDS.toMillis(t2.get(ttlMs + 3000, TimeUnit.MILLISECONDS) - killed);
            check(after1 <= ttlMs + 1000 && after2 <= ttlMs + 1000,
                    "the waiters got the keys " + after1 + " and " + after2 + " ms after the node died");
            check(w1.get().fence() > node.fences[0] && w2.get().fence() > node.fences[1], "with greater fences");
            w1.get().release();
            w2.get().release();
        }
    }

    /** A release or a close has no lock delay; an expired session's keys are held for it. */
    static void lockDelayAfterExpiryOnly(ClientTests.Env env) throws Exception {
        Duration ttl = Duration.ofMillis(1000);
        Duration delay = Duration.ofMillis(2500);
        try (LockBroker broker = LockBroker.create(env.url()); LockBroker other = LockBroker.create(env.url())) {
            String k1 = env.key("s-delay");
            String k2 = env.key("s-delay");
            String k3 = env.key("s-delay");
            Session session = broker.openSession(ttl, delay);
            equal(delay, session.lockDelay(), "the lock delay");
            Lease a = session.acquire(k1, Duration.ZERO);
            Lease b = session.acquire(k2, Duration.ZERO);
            b.release();
            check(a.isHeld() && session.isAlive(), "releasing one lease leaves the session and the others");
            other.tryAcquire(k2, ttl).orElseThrow(() -> new AssertionError("a release had a lock delay")).release();
            session.close();
            other.tryAcquire(k1, ttl).orElseThrow(() -> new AssertionError("a close had a lock delay")).release();
            try (Holder node = Holder.start(env.url(), ttl.toMillis(), delay.toMillis(), k3)) {
                long waitersBefore = metric(env.url(), "lockbroker_waiters");
                CompletableFuture<Lease> waiter = async(
                        () -> other.acquire(k3, Duration.ofSeconds(10), Duration.ofSeconds(20)));
                CompletableFuture<Long> grantedAt = waiter.thenApply(lease -> System.nanoTime());
                awaitMetric(env.url(), "lockbroker_waiters", waitersBefore + 1);
                long killed = System.nanoTime();
                node.kill();
                long after = TimeUnit.NANOSECONDS.toMillis(grantedAt.get(10, TimeUnit.SECONDS) - killed);
                check(after >= delay.toMillis() && after <= ttl.toMillis() + delay.toMillis() + 1000,
                        "the waiter got the expired session's key " + after + " ms after the node died");
                check(waiter.get().fence() > node.fences[0], "with a greater fence");
                waiter.get().release();
            }
        }
    }

    /**
     * Keep-alives failing (503s): the session is lost within its ttl, every lease under it too
     * (their callbacks before the session's), and the client closes it so its keys go at once.
     */
    static void lostWhenKeepAlivesFail(ClientTests.Env env) throws Exception {
        try (RecordingProxy proxy = new RecordingProxy(env.url());
                LockBroker broker = LockBroker.create(proxy.url());
                LockBroker other = LockBroker.create(env.url())) {
            String k1 = env.key("s-fail");
            String k2 = env.key("s-fail");
            Duration ttl = Duration.ofMillis(1500);
            Session session = broker.openSession(ttl);
            Lease a = session.acquire(k1, Duration.ZERO);
            Lease b = session.lock(k2).shared().acquire();
            List<String> order = Collections.synchronizedList(new ArrayList<>());
            CompletableFuture<Long> lost = new CompletableFuture<>();
            a.onLost(() -> order.add("a"));
            b.onLost(() -> order.add("b"));
            session.onLost(() -> {
                order.add("session");
                lost.complete(System.nanoTime());
            });
            proxy.fault(KEEP_ALIVE, RecordingProxy.Fault.ANSWER_503, Integer.MAX_VALUE);
            long t0 = System.nanoTime();
            long after = TimeUnit.NANOSECONDS.toMillis(lost.get(ttl.toMillis() + 1000, TimeUnit.MILLISECONDS) - t0);
            check(after <= ttl.toMillis(), "lost " + after + " ms after the keep-alives began to fail, within the ttl");
            equal(List.of("a", "b", "session"), new ArrayList<>(order), "every lease's callback, then the session's");
            check(!session.isAlive() && !a.isHeld() && !b.isHeld(), "not alive, nothing held");
            String reason = session.lostReason().orElse("");
            check(reason.contains("without a confirmed keep-alive") && reason.contains("503"), "the reason: " + reason);
            check(a.lostReason().orElse("").contains("session"), "the lease's reason names the session: " + a.lostReason());
            proxy.awaitCount(c -> "DELETE".equals(c.method) && c.path.startsWith("/sessions/"), 1, Duration.ofSeconds(5));
            other.tryAcquire(k1, ttl).orElseThrow(() -> new AssertionError("the lost session's key was not let go"))
                    .release();
            LockBrokerException refused = failure(() -> session.acquire(k2, Duration.ZERO));
            equal("no_session", refused.code(), "an acquire under a lost session: " + refused.getMessage());
        }
    }

    /**
     * A session ended at the broker: its keep-alive's 404 loses it and its leases; an acquire
     * under it, even one waiting, is answered {@code 404 no_session}, which loses it at once.
     */
    static void endedAtBroker(ClientTests.Env env) throws Exception {
        try (RecordingProxy proxy = new RecordingProxy(env.url());
                LockBroker broker = LockBroker.create(proxy.url());
                LockBroker other = LockBroker.create(env.url())) {
            String k1 = env.key("s-ended");
            String k2 = env.key("s-ended");
            Duration ttl = Duration.ofMillis(1500);
            Session session = broker.openSession(ttl);
            String secret = secretOf(proxy);
            Lease a = session.acquire(k1, Duration.ZERO);
            CompletableFuture<String> lost = new CompletableFuture<>();
            a.onLost(() -> lost.complete(a.lostReason().orElse("")));
            equal(204, send("DELETE", env.url() + "/sessions/" + secret).statusCode(), "ended behind the client's back");
            check(lost.get(ttl.toMillis(), TimeUnit.MILLISECONDS).contains("404"), "the lease lost: " + a.lostReason());
            check(!session.isAlive() && session.lostReason().orElse("").contains("404"), "lost: " + session.lostReason());
            LockBrokerException refused = failure(() -> session.acquire(k2, Duration.ZERO));
            equal("no_session", refused.code(), "code");
            equal(404, refused.status(), "status");
            other.tryAcquire(k1, ttl).orElseThrow(() -> new AssertionError("k1 still held")).release();

            Session second = broker.openSession(Duration.ofSeconds(20));
            String secret2 = secretOf(proxy);
            Lease held = other.acquire(k2, Duration.ofSeconds(10), Duration.ZERO);
            long waitersBefore = metric(env.url(), "lockbroker_waiters");
            CompletableFuture<LockBrokerException> waiting = async(
                    () -> failure(() -> second.acquire(k2, Duration.ofSeconds(20))));
            awaitMetric(env.url(), "lockbroker_waiters", waitersBefore + 1);
            equal(204, send("DELETE", env.url() + "/sessions/" + secret2).statusCode(), "the waiter's session ended");
            LockBrokerException e = waiting.get(5, TimeUnit.SECONDS);
            check(e.status() == 404 && "no_session".equals(e.code()), "the waiter was answered 404 no_session: " + e);
            check(!second.isAlive() && second.lostReason().orElse("").contains("no_session"),
                    "the session lost at once: " + second.lostReason());
            held.release();
            other.tryAcquire(k2, ttl).orElseThrow(() -> new AssertionError("the waiter left something behind")).release();
        }
    }

    /** The secret is in no toString, exception message or log line, also when closing it fails. */
    static void secretNeverShown(ClientTests.Env env) throws Exception {
        List<String> logged = Collections.synchronizedList(new ArrayList<>());
        Handler handler = new Handler() {
            @Override
            public void publish(LogRecord record) {
                logged.add(record.getMessage());
            }

            @Override
            public void flush() {
            }

            @Override
            public void close() {
            }
        };
        Logger root = Logger.getLogger("");
        root.addHandler(handler);
        try (RecordingProxy proxy = new RecordingProxy(env.url());
                LockBroker broker = LockBroker.builder().url(proxy.url()).releaseTimeout(Duration.ofMillis(300)).build()) {
            String key = env.key("s-secret");
            Session session = broker.openSession(Duration.ofSeconds(10));
            String secret = secretOf(proxy);
            check(secret.length() >= 16, "the broker sent a secret");
            Lease lease = session.acquire(key, Duration.ZERO);
            List<String> shown = new ArrayList<>(List.of(session.toString(), lease.toString()));
            check(session.toString().contains("alive") && lease.toString().contains(key), "toString shows the rest: " + shown);
            proxy.fault(c -> "DELETE".equals(c.method) && c.path.startsWith("/sessions/"), RecordingProxy.Fault.ANSWER_500,
                    Integer.MAX_VALUE);
            session.close(); // refused: a warning, not an exception
            shown.add(session.toString());
            shown.add(lease.toString());
            try {
                session.acquire(key, Duration.ZERO);
                throw new AssertionError("acquired under a closed session");
            } catch (IllegalStateException e) {
                shown.add(e.getMessage());
            }
            check(logged.stream().anyMatch(m -> m.contains("close a session")), "the refused close was logged: " + logged);
            shown.addAll(logged);
            check(shown.stream().noneMatch(s -> s.contains(secret)), "the secret shown somewhere");
            equal(204, send("DELETE", env.url() + "/sessions/" + secret).statusCode(), "closed for real");
        } finally {
            root.removeHandler(handler);
        }
    }

    /** Closing a session whose broker is gone returns, bounded by the release timeout, and never throws. */
    static void closeNeverThrows(ClientTests.Env env) throws Exception {
        try (Processes.Broker own = Processes.Broker.start(null);
                LockBroker broker = LockBroker.builder().url(own.url()).releaseTimeout(Duration.ofMillis(300)).build()) {
            Session session = broker.openSession(Duration.ofSeconds(5));
            Lease lease = session.acquire(env.key("s-gone"), Duration.ZERO);
            own.stop();
            long t0 = System.nanoTime();
            session.close();
            long ms = TimeUnit.NANOSECONDS.toMillis(System.nanoTime() - t0);
            check(ms < 3000, "close returned after " + ms + " ms");
            check(!session.isAlive() && !lease.isHeld(), "closed");
            session.close();
        }
    }

    /**
     * An open whose answer was lost (a 503 after the broker made it) is retried with the same
     * request_id and returns the one session made; an acquire under it likewise.
     */
    static void openRetriedWithOneRequestId(ClientTests.Env env) throws Exception {
        try (RecordingProxy proxy = new RecordingProxy(env.url());
                LockBroker broker = LockBroker.create(proxy.url());
                LockBroker other = LockBroker.create(env.url())) {
            String key = env.key("s-retry");
            Predicate<RecordingProxy.Call> open = c -> "POST".equals(c.method) && c.path.equals("/sessions");
            proxy.fault(open, RecordingProxy.Fault.FORWARD_THEN_503, 1);
            proxy.fault(c -> c.isAcquire() && c.path.endsWith("/" + key), RecordingProxy.Fault.FORWARD_THEN_503, 1);
            try (Session session = broker.openSession(Duration.ofSeconds(10))) {
                List<RecordingProxy.Call> opens = new ArrayList<>();
                proxy.calls().stream().filter(open).forEach(opens::add);
                equal(2, opens.size(), "one retry: " + opens);
                equal(ClientTests.requestId(opens.get(0).body), ClientTests.requestId(opens.get(1).body),
                        "the retry kept the request_id");
                equal(201, opens.get(0).upstreamStatus, "the first try made the session");
                String secret = secretOf(proxy);
                check(opens.get(0).upstreamBody.contains(secret), "the session returned is the one the first try made");
                Lease lease = session.acquire(key, Duration.ofSeconds(5));
                equal(lease.fence(), fenceOf(get(env.url() + "/locks/" + key).body()), "the one grant, under the session");
                check(other.tryAcquire(key, Duration.ofSeconds(1)).isEmpty(), "held");
                HttpResponse<String> shown = get(env.url() + "/sessions/" + secret);
                equal(1, holders(shown.body()), "one lease under the session: " + shown.body());
            }
            equal(404, get(env.url() + "/locks/" + key).statusCode(), "released with the session");
        }
    }

    /**
     * A lease under a session renews to the session's end; force-released, its renew() says so
     * and it is lost, while the session and its other leases go on.
     */
    static void forceReleasedLeaseSeenByItsRenew(ClientTests.Env env) throws Exception {
        try (LockBroker broker = LockBroker.create(env.url())) {
            String k1 = env.key("s-forced");
            String k2 = env.key("s-forced");
            Session session = broker.openSession(Duration.ofSeconds(10));
            Lease a = session.acquire(k1, Duration.ZERO);
            Lease b = session.acquire(k2, Duration.ZERO);
            a.renew();
            check(a.isHeld(), "renewed");
            CompletableFuture<String> lost = new CompletableFuture<>();
            a.onLost(() -> lost.complete(a.lostReason().orElse("")));
            check(broker.forceRelease(k1), "force-released");
            try {
                a.renew();
                throw new AssertionError("renewed a force-released lease");
            } catch (LeaseLostException e) {
                check(lost.get(5, TimeUnit.SECONDS).contains("404"), "lost, by the 404: " + e.getMessage());
            }
            check(!a.isHeld() && session.isAlive() && b.isHeld(), "the session and its other lease go on");
            session.close();
            check(!b.isHeld(), "closed");
        }
    }

    // -------------------------------------------------------------------------------------------
    // Helpers

    /** What {@code call} threw: it must throw a {@link LockBrokerException}. */
    private static LockBrokerException failure(Runnable call) {
        try {
            call.run();
        } catch (LockBrokerException e) {
            return e;
        }
        throw new AssertionError("no LockBrokerException");
    }

    /** The secret of the last session opened through the proxy, from the broker's answer. */
    private static String secretOf(RecordingProxy proxy) {
        List<RecordingProxy.Call> opens = new ArrayList<>();
        for (RecordingProxy.Call c : proxy.calls()) {
            if ("POST".equals(c.method) && c.path.equals("/sessions") && c.upstreamStatus == 201) {
                opens.add(c);
            }
        }
        check(!opens.isEmpty(), "no session opened through the proxy");
        Matcher m = Pattern.compile("\"session\"\\s*:\\s*\"([^\"]+)\"").matcher(opens.get(opens.size() - 1).upstreamBody);
        check(m.find(), "no session in the broker's answer");
        return m.group(1);
    }

    /** A {@link SessionHolderMain} in a JVM of its own, holding keys under a session of its own. */
    private static final class Holder implements AutoCloseable {
        final Processes.Child child;
        final long[] fences;

        private Holder(Processes.Child child, long[] fences) {
            this.child = child;
            this.fences = fences;
        }

        static Holder start(String url, long ttlMs, long lockDelayMs, String... keys) throws Exception {
            List<String> command = new ArrayList<>(List.of(Path.of(System.getProperty("java.home"), "bin", "java").toString(),
                    "-cp", System.getProperty("java.class.path"), SessionHolderMain.class.getName(), url,
                    String.valueOf(ttlMs), String.valueOf(lockDelayMs)));
            command.addAll(Arrays.asList(keys));
            Processes.Child child = new Processes.Child(command, Pattern.compile("^held ([0-9 ]+)$"));
            Matcher held = child.awaitReady();
            return new Holder(child, Arrays.stream(held.group(1).trim().split(" ")).mapToLong(Long::parseLong).toArray());
        }

        /** SIGKILL: the node dies, and its keep-alives with it. */
        void kill() throws InterruptedException {
            child.kill();
        }

        @Override
        public void close() {
            child.close();
        }
    }
}
