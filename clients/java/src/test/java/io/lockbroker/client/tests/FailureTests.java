package io.lockbroker.client.tests;

import static io.lockbroker.client.tests.ClientTests.async;
import static io.lockbroker.client.tests.ClientTests.check;
import static io.lockbroker.client.tests.ClientTests.equal;
import static io.lockbroker.client.tests.ClientTests.get;
import static io.lockbroker.client.tests.ClientTests.requestId;

import io.lockbroker.client.BrokerUnavailableException;
import io.lockbroker.client.Lease;
import io.lockbroker.client.Leadership;
import io.lockbroker.client.LockBroker;
import io.lockbroker.client.LockBrokerException;
import java.time.Duration;
import java.util.ArrayList;
import java.util.Arrays;
import java.util.List;
import java.util.concurrent.BlockingQueue;
import java.util.concurrent.CompletableFuture;
import java.util.concurrent.LinkedBlockingQueue;
import java.util.concurrent.TimeUnit;
import java.util.concurrent.atomic.AtomicReference;
import java.util.function.Consumer;
import java.util.stream.Collectors;

/**
 * What the client does with answers that are not a grant: a 5xx that is not the broker's, a
 * revoked or narrowed bearer token, renewals in trouble, a key that breaks the key rule.
 */
final class FailureTests {
    private FailureTests() {
    }

    /**
     * 429, 502, 503, 504 and no answer are retried; any other 5xx (the broker answers none) is a
     * {@link LockBrokerException} at once that names the status, the key and the URL: on acquire,
     * renew, watch and release alike.
     */
    static void serverErrorsOtherThanUnavailableNotRetried(ClientTests.Env env) throws Exception {
        try (RecordingProxy proxy = new RecordingProxy(env.url());
                LockBroker broker = LockBroker.create(proxy.url())) {
            String refusedKey = env.key("500");
            proxy.fault(c -> c.isAcquire() && c.path.endsWith("/" + refusedKey), RecordingProxy.Fault.ANSWER_500,
                    Integer.MAX_VALUE);
            long t0 = System.nanoTime();
            LockBrokerException refused = expectRefusal(() -> broker.acquire(refusedKey, Duration.ofSeconds(10),
                    Duration.ofSeconds(10)), 500, "acquire");
            long ms = TimeUnit.NANOSECONDS.toMillis(System.nanoTime() - t0);
            check(ms < 3000, "a 500 ended a 10 s wait at once, not after " + ms + " ms");
            check(refused.getMessage().contains("'" + refusedKey + "'") && refused.getMessage().contains(proxy.url()),
                    "names the key and the URL: " + refused.getMessage());
            check(refused.getMessage().contains("upstream handler crashed"), "shows what answered: " + refused.getMessage());
            // (A clean-up may follow, with wait_ms 0, in case something behind the 500 granted it.)
            equal(1L, proxy.count(c -> c.isAcquire() && c.path.endsWith("/" + refusedKey)
                    && !c.body.contains("\"wait_ms\":0,")), "the wait was not tried again: " + proxy.calls());

            // A 502 (a proxy's HTML page) twice: retried with the same request_id, then granted.
            String key = env.key("502");
            proxy.fault(c -> c.isAcquire() && c.path.endsWith("/" + key), RecordingProxy.Fault.ANSWER_502, 2);
            Lease lease = broker.lock(key).ttl(Duration.ofSeconds(10)).maxWait(Duration.ofSeconds(10))
                    .autoRenew(false).acquire();
            List<RecordingProxy.Call> posts = proxy.calls().stream()
                    .filter(c -> c.isAcquire() && c.path.endsWith("/" + key)).collect(Collectors.toList());
            equal(Arrays.asList(502, 502, 201), posts.stream().map(c -> c.status).collect(Collectors.toList()),
                    "502s retried: " + posts);
            equal(1L, posts.stream().map(c -> requestId(c.body)).distinct().count(), "one request_id: " + posts);

            // renew(): a 500 is a refusal (the lease is not lost by it); a 502 is "unavailable".
            proxy.fault(c -> c.isRenew() && c.path.contains("/" + key + "/"), RecordingProxy.Fault.ANSWER_500, 1);
            expectRefusal(lease::renew, 500, "renew");
            check(lease.isHeld(), "a 500 on a renewal does not lose the lease");
            proxy.fault(c -> c.isRenew() && c.path.contains("/" + key + "/"), RecordingProxy.Fault.ANSWER_502, 1);
            try {
                lease.renew();
                throw new AssertionError("renewed through a 502");
            } catch (BrokerUnavailableException e) {
                equal(502, e.status(), "a 502 on renew");
                check(e.getMessage().contains("502 Bad Gateway") && e.getMessage().contains(proxy.url()),
                        "names what answered and where: " + e.getMessage());
            }
            lease.renew();

            // watch: a 500 at once, whatever the wait.
            proxy.fault(c -> "GET".equals(c.method) && c.path.startsWith("/locks/" + key + "?"),
                    RecordingProxy.Fault.ANSWER_500, 1);
            t0 = System.nanoTime();
            expectRefusal(() -> broker.watch(key, lease.fence(), Duration.ofSeconds(10)), 500, "watch");
            check(System.nanoTime() - t0 < TimeUnit.SECONDS.toNanos(3), "the watch ended at once");

            // release: a 502 is retried until released; a 500 is not retried (the lease then ends by its ttl).
            proxy.fault(c -> "DELETE".equals(c.method) && c.path.endsWith("/" + key), RecordingProxy.Fault.ANSWER_502, 2);
            lease.release();
            equal(3L, proxy.count(c -> "DELETE".equals(c.method) && c.path.endsWith("/" + key)), "release retried 502s");
            equal(404, get(env.url() + "/locks/" + key).statusCode(), "released through the 502s");
            String other = env.key("5xx-release");
            Lease second = broker.acquire(other, Duration.ofSeconds(10), Duration.ZERO);
            proxy.fault(c -> "DELETE".equals(c.method) && c.path.endsWith("/" + other), RecordingProxy.Fault.ANSWER_500, 1);
            second.release();
            equal(1L, proxy.count(c -> "DELETE".equals(c.method) && c.path.endsWith("/" + other)), "a 500 not retried");
            check(!second.isHeld(), "released on the client's side");
            ClientTests.send("DELETE", env.url() + "/locks/" + other + "?force=true");

            // A grant answered with a proxy's 500 is not returned, and not left behind either.
            String granted = env.key("5xx-granted");
            proxy.fault(c -> c.isAcquire() && c.path.endsWith("/" + granted), RecordingProxy.Fault.FORWARD_THEN_500, 1);
            expectRefusal(() -> broker.acquire(granted, Duration.ofSeconds(20), Duration.ofSeconds(5)), 500, "acquire");
            proxy.awaitCount(c -> "DELETE".equals(c.method) && c.path.endsWith("/" + granted) && c.status == 204, 1,
                    Duration.ofSeconds(10));
            equal(404, get(env.url() + "/locks/" + granted).statusCode(), "the grant behind the 500 was released");
        }
    }

    /** A bearer token revoked (401) or narrowed (403) while a lease is held: lost at its next renewal, saying so. */
    static void revokedTokenLosesLeaseNamingIt(ClientTests.Env env) throws Exception {
        String a = Processes.Broker.token("app-a", "secret-token-a-0123456789", "", "lock");
        String b = Processes.Broker.token("app-b", "secret-token-b-0123456789", "", "lock");
        try (Processes.Broker own = Processes.Broker.withAuth(a + b);
                LockBroker clientA = LockBroker.builder().url(own.url()).authToken("secret-token-a-0123456789").build();
                LockBroker clientB = LockBroker.builder().url(own.url()).authToken("secret-token-b-0123456789").build()) {
            Duration ttl = Duration.ofMillis(1500);
            Lease leaseA = clientA.acquire(env.key("revoked"), ttl, Duration.ZERO);
            Lease leaseB = clientB.acquire(env.key("narrowed"), ttl, Duration.ZERO);
            CompletableFuture<String> lostA = new CompletableFuture<>();
            CompletableFuture<String> lostB = new CompletableFuture<>();
            leaseA.onLost(() -> lostA.complete(leaseA.lostReason().orElse("")));
            leaseB.onLost(() -> lostB.complete(leaseB.lostReason().orElse("")));
            // app-a is gone from the file; app-b may only touch keys under "elsewhere:".
            own.reloadAuth(Processes.Broker.token("app-b", "secret-token-b-0123456789", "elsewhere:", "lock"));
            String reasonA = lostA.get(10, TimeUnit.SECONDS);
            String reasonB = lostB.get(10, TimeUnit.SECONDS);
            check(reasonA.contains("401") && reasonA.contains("unauthorized"), "a revoked token: " + reasonA);
            check(reasonB.contains("403") && reasonB.contains("forbidden"), "a narrowed token: " + reasonB);
            check(!leaseA.isHeld() && !leaseB.isHeld(), "neither is held");
            leaseA.release();
            leaseB.release();
        }
    }

    /**
     * Leadership with a token that may not take the key (403): the campaign ends at once with
     * the refusal, it does not retry for ever; with an unknown token (401) the constructor throws.
     */
    static void leadershipRefusedFailsFast(ClientTests.Env env) throws Exception {
        String reader = Processes.Broker.token("reader", "secret-reader-0123456789", "", "read");
        try (Processes.Broker own = Processes.Broker.withAuth(reader);
                LockBroker readOnly = LockBroker.builder().url(own.url()).authToken("secret-reader-0123456789").build();
                LockBroker unknown = LockBroker.builder().url(own.url()).authToken("not-a-token").build()) {
            String key = env.key("leader-refused");
            CompletableFuture<LockBrokerException> failed = new CompletableFuture<>();
            long t0 = System.nanoTime();
            Leadership leadership = new Leadership(readOnly, key, "node-r", Duration.ofSeconds(5));
            try {
                leadership.onFailure(failed::complete);
                LockBrokerException e = failed.get(5, TimeUnit.SECONDS);
                long ms = TimeUnit.NANOSECONDS.toMillis(System.nanoTime() - t0);
                equal(403, e.status(), "the refusal's status");
                check(e.getMessage().contains(key) && e.getMessage().contains(own.url()), "names key and URL: " + e.getMessage());
                check(ms < 3000, "failed within " + ms + " ms");
                check(!leadership.isLeader(), "not leading");
                equal(403, leadership.failure().orElseThrow().status(), "failure()");
                AtomicReference<LockBrokerException> late = new AtomicReference<>();
                leadership.onFailure(late::set);
                check(late.get() != null, "a callback registered after the failure ran at once");
            } finally {
                leadership.close();
            }
            try {
                new Leadership(unknown, key, "node-u", Duration.ofSeconds(5)).close();
                throw new AssertionError("a Leadership with an unknown token started");
            } catch (BrokerUnavailableException e) {
                throw new AssertionError("401 reported as unavailable", e);
            } catch (LockBrokerException e) {
                equal(401, e.status(), "an unknown token's status");
                check(e.getMessage().contains(own.url()), "names the URL: " + e.getMessage());
            }
        }
    }

    /** The renewal-trouble hook: told once per run of failed renewals, before the lease is lost. */
    static void troubleHookBeforeLoss(ClientTests.Env env) throws Exception {
        try (RecordingProxy proxy = new RecordingProxy(env.url());
                LockBroker broker = LockBroker.create(proxy.url())) {
            String key = env.key("trouble");
            Lease lease = broker.acquire(key, Duration.ofMillis(1500), Duration.ZERO); // renewed every 500 ms
            BlockingQueue<String> events = new LinkedBlockingQueue<>();
            lease.onTrouble(e -> events.add("trouble " + e.status() + " " + e.getMessage()));
            lease.onLost(() -> events.add("lost " + lease.lostReason().orElse("")));
            java.util.function.Predicate<RecordingProxy.Call> renewals = c -> c.isRenew() && c.path.contains("/" + key + "/");

            // One renewal fails, the next gets through: told once, still held.
            proxy.fault(renewals, RecordingProxy.Fault.ANSWER_503, 1);
            String first = events.poll(5, TimeUnit.SECONDS);
            check(first != null && first.startsWith("trouble 503"), "told of the failed renewal: " + first);
            check(first.contains("'" + key + "'") && first.contains(proxy.url()), "names key and URL: " + first);
            long through = proxy.count(renewals.and(c -> c.status == 200));
            proxy.awaitCount(renewals.and(c -> c.status == 200), through + 1, Duration.ofSeconds(5));
            check(lease.isHeld(), "held after the renewals got through again");
            check(events.isEmpty(), "nothing more to tell: " + events);

            // Every renewal fails: told once more, then lost, the reason naming the last failure.
            proxy.fault(renewals, RecordingProxy.Fault.ANSWER_503, Integer.MAX_VALUE);
            String second = events.poll(5, TimeUnit.SECONDS);
            check(second != null && second.startsWith("trouble 503"), "told again: " + second);
            String lost = events.poll(5, TimeUnit.SECONDS);
            check(lost != null && lost.startsWith("lost") && lost.contains("without a confirmed renewal")
                    && lost.contains("503"), "then lost: " + lost);
            check(proxy.count(renewals.and(c -> c.status == 503)) >= 3, "several renewals failed meanwhile");
            check(events.isEmpty(), "told once per run of failures: " + events);
            proxy.clearFaults();
            lease.release();
        }
    }

    /** A key that breaks the rule (1 to 200 of A-Z a-z 0-9 . _ - :) is refused before anything is sent. */
    static void keyRuleCheckedBeforeSending(ClientTests.Env env) throws Exception {
        try (RecordingProxy proxy = new RecordingProxy(env.url());
                LockBroker broker = LockBroker.create(proxy.url())) {
            Duration s = Duration.ofSeconds(1);
            for (String bad : Arrays.asList(null, "", "no spaces", "slash/es", "x".repeat(201), "caf\u00e9",
                    "percent%41", "tab\there")) {
                List<Consumer<String>> calls = new ArrayList<>();
                calls.add(k -> broker.acquire(k, s, Duration.ZERO));
                calls.add(k -> broker.tryAcquire(k, s));
                calls.add(k -> broker.acquirePermit(k, 2, s, Duration.ZERO));
                calls.add(k -> broker.watch(k, 0, Duration.ZERO));
                calls.add(k -> broker.inspect(k));
                calls.add(k -> broker.forceRelease(k));
                calls.add(k -> broker.withLease(k, s, Duration.ZERO, () -> null));
                calls.add(k -> new Leadership(broker, k, "n", s).close());
                for (Consumer<String> call : calls) {
                    try {
                        call.accept(bad);
                        throw new AssertionError("the key '" + bad + "' was accepted");
                    } catch (IllegalArgumentException e) {
                        String expected = bad == null || bad.isEmpty() ? "a key is required" : "A-Z a-z 0-9 . _ - :";
                        check(e.getMessage().contains(expected), "'" + bad + "': " + e.getMessage());
                    }
                }
            }
            try {
                broker.listLocks("bad prefix");
                throw new AssertionError("a bad prefix was accepted");
            } catch (IllegalArgumentException e) {
                check(e.getMessage().contains("prefix"), e.getMessage());
            }
            equal(0, proxy.calls().size(), "nothing was sent: " + proxy.calls());
            String longest = ("Az09._-:" + env.key("k")).concat("x".repeat(200)).substring(0, 200);
            try (Lease lease = broker.acquire(longest, s, Duration.ZERO)) {
                equal(longest, lease.key(), "a 200-character key of every allowed kind is taken");
            }
        }
    }

    private static LockBrokerException expectRefusal(Runnable call, int status, String what) {
        try {
            call.run();
            throw new AssertionError(what + " succeeded through a " + status);
        } catch (BrokerUnavailableException e) {
            throw new AssertionError(what + ": a " + status + " reported as unavailable", e);
        } catch (LockBrokerException e) {
            equal(status, e.status(), what + "'s status");
            return e;
        }
    }
}
