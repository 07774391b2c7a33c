package io.lockbroker.client.tests;

import io.lockbroker.client.BrokerUnavailableException;
import io.lockbroker.client.Lease;
import io.lockbroker.client.LeaseLostException;
import io.lockbroker.client.LockBroker;
import io.lockbroker.client.LockBrokerException;
import io.lockbroker.client.LockedException;
import io.lockbroker.examples.CheckThenInsert;
import java.net.URI;
import java.net.http.HttpClient;
import java.net.http.HttpRequest;
import java.net.http.HttpResponse;
import java.time.Duration;
import java.util.ArrayList;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;
import java.util.Optional;
import java.util.concurrent.CompletableFuture;
import java.util.concurrent.ExecutorService;
import java.util.concurrent.Executors;
import java.util.concurrent.Future;
import java.util.concurrent.TimeUnit;
import java.util.concurrent.atomic.AtomicInteger;
import java.util.concurrent.atomic.AtomicReference;
import java.util.regex.Matcher;
import java.util.regex.Pattern;
import java.util.stream.Collectors;

/**
 * The Java client's tests, against real {@code lockbroker serve} processes: one on the embedded
 * store, one on a {@code redis-server} started here. A small runner (no JUnit offline): each test
 * prints "ok" or "FAIL"; the last line is {@code N passed, M failed}. Arguments filter tests by
 * name.
 */
public final class ClientTests {
    private static final HttpClient HTTP = HttpClient.newHttpClient();
    private static final AtomicInteger KEYS = new AtomicInteger();

    /** A broker to test against, with the store it runs on. */
    static final class Env {
        final String name;
        final Processes.Broker broker;
        final Processes.Redis redis;

        Env(String name, Processes.Broker broker, Processes.Redis redis) {
            this.name = name;
            this.broker = broker;
            this.redis = redis;
        }

        String url() {
            return broker.url();
        }

        String key(String test) {
            return "java-" + test + "-" + KEYS.incrementAndGet();
        }
    }

    interface Body {
        void run(Env env) throws Exception;
    }

    public static void main(String[] args) throws Exception {
        long started = System.nanoTime();
        Map<String, Body> perStore = new LinkedHashMap<>();
        perStore.put("grant_and_release", ClientTests::grantAndRelease);
        perStore.put("second_acquirer_granted_after_release", ClientTests::waitGrantedAfterRelease);
        perStore.put("granted_after_a_wait_longer_than_its_ttl_stays_held", ClientTests::waitedLongerThanTtl);
        perStore.put("locked_after_wait_and_try_acquire_empty", ClientTests::lockedAndTryEmpty);
        perStore.put("renewal_holds_lease_for_3_ttls", ClientTests::renewHolds);
        perStore.put("lost_within_ttl_after_force_release", ClientTests::lostAfterForceRelease);
        perStore.put("shared_leases_and_permits", ClientTests::sharedAndPermits);
        perStore.put("check_then_insert_leaves_one_row", ClientTests::checkThenInsert);
        perStore.put("retry_keeps_request_id_and_returns_the_one_grant", ClientTests::retrySameRequestId);
        perStore.put("unavailable_after_wait_without_grant", ClientTests::unavailable);
        perStore.put("no_renew_after_release_or_close", ClientTests::noRenewAfterClose);
        perStore.put("token_never_shown", ClientTests::tokenNeverShown);
        perStore.put("given_up_acquire_leaves_no_lease_behind", ClientTests::givenUpLeavesNothing);
        perStore.put("without_auto_renew_lost_at_its_end", ClientTests::noAutoRenew);
        perStore.put("interrupted_waiter_leaves_no_lease_behind", ClientTests::interruptedWaiter);
        perStore.put("bad_key_is_a_clear_error", ClientTests::badKey);
        perStore.put("watch_sees_grant_release_and_times_out_unchanged", WatchTests::watchSeesGrantAndRelease);
        perStore.put("follow_yields_each_change_once_in_order", WatchTests::followYieldsEachChangeOnce);
        perStore.put("leadership_one_leader_then_handover_on_close", WatchTests::oneLeaderThenHandover);
        perStore.put("leadership_revoked_when_lease_lost_then_reelected", WatchTests::revokedWhenLeaseLost);
        perStore.put("leadership_revoked_when_its_client_closes", WatchTests::revokedWhenClientCloses);
        perStore.put("session_leases_live_past_3_ttls_on_keep_alives_alone", SessionTests::leasesLivePastThreeTtls);
        perStore.put("session_close_releases_at_once", SessionTests::closeReleasesAtOnce);
        perStore.put("session_of_a_killed_node_its_keys_to_waiters_within_ttl_plus_1s",
                SessionTests::abandonedSessionLeasesGoToWaiters);
        perStore.put("session_lock_delay_after_expiry_only", SessionTests::lockDelayAfterExpiryOnly);
        perStore.put("several_keys_all_or_nothing_with_a_fence_each", SeveralKeysTests::allOrNothingWithAFenceEach);
        perStore.put("several_keys_opposite_orders_all_complete", SeveralKeysTests::oppositeOrdersAllComplete);
        perStore.put("several_keys_one_lost_loses_the_lease", SeveralKeysTests::lostKeyLosesTheLease);
        perStore.put("several_keys_release_releases_all", SeveralKeysTests::releaseReleasesAll);
        perStore.put("several_keys_retry_keeps_request_id", SeveralKeysTests::retryKeepsRequestId);
        perStore.put("several_keys_under_a_session", SeveralKeysTests::underASession);
        Map<String, Body> redisOnly = new LinkedHashMap<>();
        redisOnly.put("store_down_503s_retried_without_double_grant", ClientTests::storeDown);
        Map<String, Body> own = new LinkedHashMap<>();
        own.put("lost_within_ttl_after_broker_stopped", ClientTests::lostAfterBrokerStopped);
        // Client behaviour that does not depend on the store: on the embedded one only.
        own.put("server_errors_other_than_unavailable_not_retried", FailureTests::serverErrorsOtherThanUnavailableNotRetried);
        own.put("revoked_token_loses_lease_naming_401_or_403", FailureTests::revokedTokenLosesLeaseNamingIt);
        own.put("leadership_refused_fails_fast", FailureTests::leadershipRefusedFailsFast);
        own.put("trouble_hook_told_before_the_loss", FailureTests::troubleHookBeforeLoss);
        own.put("key_rule_checked_before_sending", FailureTests::keyRuleCheckedBeforeSending);
        own.put("with_lease_runs_work_then_releases", ApiTests::withLeaseRunsWorkThenReleases);
        own.put("with_lease_interrupts_work_when_lost", ApiTests::withLeaseInterruptsWorkWhenLost);
        own.put("inspect_list_and_force_release", ApiTests::inspectListAndForceRelease);
        own.put("from_env_reads_url_and_auth_token", ApiTests::fromEnvReadsUrlAndAuthToken);
        own.put("jars_versioned_with_sources_and_javadoc", ApiTests::jarsVersionedWithSourcesAndJavadoc);
        own.put("session_lost_when_keep_alives_fail_with_every_lease", SessionTests::lostWhenKeepAlivesFail);
        own.put("session_ended_at_broker_lost_on_404_and_no_session", SessionTests::endedAtBroker);
        own.put("session_secret_never_shown", SessionTests::secretNeverShown);
        own.put("session_close_never_throws", SessionTests::closeNeverThrows);
        own.put("session_open_retried_with_one_request_id", SessionTests::openRetriedWithOneRequestId);
        own.put("session_lease_force_released_seen_by_its_renew", SessionTests::forceReleasedLeaseSeenByItsRenew);

        List<String> filters = List.of(args);
        int[] tally = new int[2];
        // The two stores' suites run side by side, each against its own broker.
        CompletableFuture<Void> onEmbedded = async(() -> {
            try (Processes.Broker embedded = Processes.Broker.start(null)) {
                Env env = new Env("embedded", embedded, null);
                runAll(env, perStore, filters, tally);
                runAll(env, own, filters, tally);
            } catch (Exception e) {
                throw new IllegalStateException("cannot start the broker on the embedded store", e);
            }
            return null;
        });
        CompletableFuture<Void> onRedis = async(() -> {
            try (Processes.Redis redis = Processes.Redis.start();
                    Processes.Broker broker = Processes.Broker.start(redis.url())) {
                Env env = new Env("redis", broker, redis);
                awaitReady(env.url());
                runAll(env, perStore, filters, tally);
                runAll(env, redisOnly, filters, tally);
            } catch (Exception e) {
                throw new IllegalStateException("cannot start Redis and a broker on it", e);
            }
            return null;
        });
        for (CompletableFuture<Void> suite : List.of(onEmbedded, onRedis)) {
            try {
                suite.get();
            } catch (java.util.concurrent.ExecutionException e) {
                e.getCause().printStackTrace(System.out);
                synchronized (tally) {
                    tally[1]++;
                }
            }
        }
        System.out.printf("# %.1f s%n", (System.nanoTime() - started) / 1e9);
        // Nothing may print after the tally (a background release's warning, say).
        java.util.logging.Logger.getLogger("").setLevel(java.util.logging.Level.OFF);
        System.err.flush();
        synchronized (tally) {
            System.out.println(tally[0] + " passed, " + tally[1] + " failed");
            System.exit(tally[1] == 0 ? 0 : 1);
        }
    }

    private static void runAll(Env env, Map<String, Body> tests, List<String> filters, int[] tally) {
        for (Map.Entry<String, Body> test : tests.entrySet()) {
            String name = env.name + "::" + test.getKey();
            if (!filters.isEmpty() && filters.stream().noneMatch(name::contains)) {
                continue;
            }
            long t0 = System.nanoTime();
            CompletableFuture<Void> run = async(() -> {
                try {
                    test.getValue().run(env);
                } catch (Exception e) {
                    throw new RuntimeException(e);
                }
                return null;
            });
            String failure = null;
            try {
                run.get(30, TimeUnit.SECONDS);
            } catch (java.util.concurrent.ExecutionException e) {
                Throwable cause = e.getCause();
                while (cause instanceof RuntimeException && cause.getCause() != null
                        && !(cause instanceof LockBrokerException) && cause.getClass() == RuntimeException.class) {
                    cause = cause.getCause();
                }
                java.io.StringWriter trace = new java.io.StringWriter();
                cause.printStackTrace(new java.io.PrintWriter(trace));
                failure = trace.toString();
            } catch (java.util.concurrent.TimeoutException e) {
                failure = "did not finish within 30 s";
            } catch (InterruptedException e) {
                failure = "interrupted";
            }
            long ms = (System.nanoTime() - t0) / 1_000_000;
            synchronized (tally) {
                if (failure == null) {
                    tally[0]++;
                    System.out.println("ok   " + name + " (" + ms + " ms)");
                } else {
                    tally[1]++;
                    System.out.println("FAIL " + name + " (" + ms + " ms): " + failure);
                }
            }
        }
    }

    // -------------------------------------------------------------------------------------------
    // Tests

    static void grantAndRelease(Env env) throws Exception {
        try (LockBroker broker = LockBroker.builder().url(env.url() + "/").build()) {
            String key = env.key("grant");
            Lease lease = broker.acquire(key, Duration.ofSeconds(10), Duration.ZERO);
            check(lease.isHeld(), "a fresh lease is held");
            equal(key, lease.key(), "key");
            check(lease.fence() > 0, "the fence is positive");
            equal(lease.fence(), fenceOf(get(env.url() + "/locks/" + key).body()), "the broker shows the lease's fence");
            // Ownership is the lease object, not the thread: another thread releases it.
            async(() -> {
                lease.release();
                return null;
            }).get(10, TimeUnit.SECONDS);
            check(!lease.isHeld(), "a released lease is not held");
            equal(404, get(env.url() + "/locks/" + key).statusCode(), "released at the broker");
            lease.release();
            lease.close();
            try (Lease again = broker.acquire(key, Duration.ofSeconds(10), Duration.ZERO)) {
                check(again.fence() > lease.fence(), "the next grant's fence is greater");
            }
            equal(404, get(env.url() + "/locks/" + key).statusCode(), "try-with-resources released it");
        }
    }

    static void waitGrantedAfterRelease(Env env) throws Exception {
        try (LockBroker one = LockBroker.create(env.url()); LockBroker two = LockBroker.create(env.url())) {
            String key = env.key("wait");
            Lease first = one.acquire(key, Duration.ofSeconds(10), Duration.ZERO);
            long waitersBefore = metric(env.url(), "lockbroker_waiters");
            CompletableFuture<Lease> second = async(
                    () -> two.acquire(key, Duration.ofSeconds(10), Duration.ofSeconds(20)));
            awaitMetric(env.url(), "lockbroker_waiters", waitersBefore + 1);
            check(!second.isDone(), "the second acquirer waits at the broker while the first holds the lock");
            first.release();
            Lease granted = second.get(10, TimeUnit.SECONDS);
            check(granted.isHeld(), "the waiter got the lock once it was released");
            check(granted.fence() > first.fence(), "with a greater fence");
            granted.release();
        }
    }

    static void waitedLongerThanTtl(Env env) throws Exception {
        try (LockBroker one = LockBroker.create(env.url()); LockBroker two = LockBroker.create(env.url())) {
            String key = env.key("longwait");
            Duration ttl = Duration.ofMillis(1000);
            Lease first = one.acquire(key, Duration.ofSeconds(10), Duration.ZERO);
            long waitersBefore = metric(env.url(), "lockbroker_waiters");
            CompletableFuture<Lease> second = async(() -> two.acquire(key, ttl, Duration.ofSeconds(20)));
            awaitMetric(env.url(), "lockbroker_waiters", waitersBefore + 1);
            // The waiter waits longer than its own ttl: its lease must not count as over on arrival.
            Thread.sleep(1500);
            first.release();
            Lease granted = second.get(10, TimeUnit.SECONDS);
            check(granted.isHeld(), "held on arrival");
            Thread.sleep(1500); // more than its ttl: held by its renewals
            check(granted.isHeld(), "still held");
            equal(granted.fence(), fenceOf(get(env.url() + "/locks/" + key).body()), "the broker holds it");
            granted.release();
        }
    }

    static void lockedAndTryEmpty(Env env) throws Exception {
        try (LockBroker one = LockBroker.create(env.url()); LockBroker two = LockBroker.create(env.url())) {
            String key = env.key("locked");
            Lease held = one.acquire(key, Duration.ofSeconds(10), Duration.ZERO);
            try {
                two.acquire(key, Duration.ofSeconds(10), Duration.ofMillis(300));
                throw new AssertionError("acquired a held lock");
            } catch (LockedException e) {
                check(e instanceof LockBrokerException, "LockedException is a LockBrokerException");
                equal(409, e.status(), "status");
                check(e.retryAfter() != null && e.retryAfter().toMillis() > 0, "it says when the lease ends");
                check(e.getMessage().contains("'" + key + "'") && e.getMessage().contains(env.url()),
                        "names the key and the URL: " + e.getMessage());
            }
            check(two.tryAcquire(key, Duration.ofSeconds(10)).isEmpty(), "tryAcquire of a held lock is empty");
            held.release();
            Optional<Lease> free = two.tryAcquire(key, Duration.ofSeconds(10));
            check(free.isPresent(), "tryAcquire of a free lock grants it");
            free.get().release();
        }
    }

    static void renewHolds(Env env) throws Exception {
        try (LockBroker broker = LockBroker.create(env.url()); LockBroker other = LockBroker.create(env.url())) {
            String key = env.key("renew");
            long renewedBefore = metric(env.url(), "lockbroker_renewals_total{space=\"locks\",result=\"renewed\"}");
            Duration ttl = Duration.ofMillis(1000);
            Lease lease = broker.acquire(key, ttl, Duration.ZERO);
            long end = System.nanoTime() + TimeUnit.MILLISECONDS.toNanos(3300);
            // Holding the lease for 3.3 ttls is what is tested: the time passing is the point.
            while (System.nanoTime() < end) {
                check(lease.isHeld(), "held throughout");
                Thread.sleep(100);
            }
            check(other.tryAcquire(key, ttl).isEmpty(), "nobody else could take it after 3 ttls");
            equal(lease.fence(), fenceOf(get(env.url() + "/locks/" + key).body()), "same lease at the broker");
            long renewed = metric(env.url(), "lockbroker_renewals_total{space=\"locks\",result=\"renewed\"}") - renewedBefore;
            check(renewed >= 3, "renewed at least 3 times, not " + renewed);
            lease.release();
        }
    }

    static void lostAfterForceRelease(Env env) throws Exception {
        try (LockBroker broker = LockBroker.create(env.url())) {
            String key = env.key("forced");
            Duration ttl = Duration.ofMillis(1500);
            Lease lease = broker.acquire(key, ttl, Duration.ZERO);
            CompletableFuture<String> lost = new CompletableFuture<>();
            AtomicInteger calls = new AtomicInteger();
            lease.onLost(() -> {
                calls.incrementAndGet();
                lost.complete(Thread.currentThread().getName());
            });
            equal(204, send("DELETE", env.url() + "/locks/" + key + "?force=true").statusCode(), "force release");
            String thread = lost.get(ttl.toMillis(), TimeUnit.MILLISECONDS); // within the ttl
            check(!lease.isHeld(), "not held once lost");
            check(thread.startsWith("lockbroker-"), "the callback ran on a client thread, not " + thread);
            check(lease.lostReason().orElse("").contains("404"), "the reason names the answer: " + lease.lostReason());
            AtomicReference<String> late = new AtomicReference<>();
            lease.onLost(() -> late.set(Thread.currentThread().getName()));
            equal(Thread.currentThread().getName(), late.get(), "a callback registered after the loss ran at once");
            try {
                lease.ensureHeld();
                throw new AssertionError("ensureHeld passed on a lost lease");
            } catch (LeaseLostException e) {
                check(e.getMessage().contains(key), "names the key");
            }
            lease.release();
            lease.release();
            // The renewer has stopped: a new lease on the key is not disturbed, and no second signal comes.
            try (Lease next = broker.acquire(key, ttl, Duration.ZERO)) {
                check(next.isHeld(), "the key was free for the next one");
            }
            equal(1, calls.get(), "the first callback ran once");
        }
    }

    static void sharedAndPermits(Env env) throws Exception {
        try (LockBroker broker = LockBroker.create(env.url())) {
            String key = env.key("shared");
            Duration ttl = Duration.ofSeconds(5);
            Lease a = broker.acquireShared(key, ttl, Duration.ZERO);
            Lease b = broker.acquireShared(key, ttl, Duration.ZERO);
            check(a.isHeld() && b.isHeld(), "two shared leases at once");
            equal(Lease.Kind.SHARED, a.kind(), "kind");
            check(broker.tryAcquire(key, ttl).isEmpty(), "no exclusive lease with shared holders");
            a.release();
            b.release();
            broker.tryAcquire(key, ttl).orElseThrow().release();

            String sem = env.key("sem");
            Lease p1 = broker.acquirePermit(sem, 2, ttl, Duration.ZERO);
            Lease p2 = broker.acquirePermit(sem, 2, ttl, Duration.ZERO);
            equal(Lease.Kind.PERMIT, p1.kind(), "kind");
            equal(2, p1.limit(), "limit");
            check(broker.tryAcquirePermit(sem, 2, ttl).isEmpty(), "both permits taken");
            try {
                broker.tryAcquirePermit(sem, 3, ttl);
                throw new AssertionError("a different limit was accepted");
            } catch (LockedException e) {
                throw new AssertionError("limit_mismatch reported as locked", e);
            } catch (LockBrokerException e) {
                equal("limit_mismatch", e.code(), "code");
            }
            long waitersBefore = metric(env.url(), "lockbroker_waiters");
            CompletableFuture<Lease> third = async(
                    () -> broker.acquirePermit(sem, 2, ttl, Duration.ofSeconds(20)));
            awaitMetric(env.url(), "lockbroker_waiters", waitersBefore + 1);
            p1.release();
            Lease p3 = third.get(10, TimeUnit.SECONDS);
            check(p3.isHeld() && p3.fence() > p2.fence(), "the waiter got the freed permit");
            p2.release();
            p3.release();
            HttpResponse<String> after = get(env.url() + "/semaphores/" + sem);
            check(after.statusCode() == 404 || holders(after.body()) == 0, "every permit released: " + after.body());
        }
    }

    static void checkThenInsert(Env env) throws Exception {
        CheckThenInsert.BusinessLogTable table = new CheckThenInsert.BusinessLogTable();
        ExecutorService pool = Executors.newFixedThreadPool(16);
        try (LockBroker node1 = LockBroker.create(env.url()); LockBroker node2 = LockBroker.create(env.url())) {
            CheckThenInsert[] nodes = {new CheckThenInsert(node1, table), new CheckThenInsert(node2, table)};
            String name = env.key("business");
            List<Future<Boolean>> results = new ArrayList<>();
            for (int i = 0; i < 200; i++) {
                CheckThenInsert node = nodes[i % 2];
                results.add(pool.submit(() -> node.saveOnce(name)));
            }
            int inserted = 0;
            for (Future<Boolean> r : results) {
                inserted += r.get(20, TimeUnit.SECONDS) ? 1 : 0;
            }
            equal(1, inserted, "one request inserted");
            equal(1, table.count(name), "one row");
        } finally {
            pool.shutdownNow();
        }
    }

    static void retrySameRequestId(Env env) throws Exception {
        try (RecordingProxy proxy = new RecordingProxy(env.url());
                LockBroker broker = LockBroker.create(proxy.url());
                LockBroker other = LockBroker.create(env.url())) {
            String key = env.key("retry");
            // The broker grants the first request; the client is told 503 instead.
            proxy.fault(c -> c.isAcquire() && c.path.endsWith("/" + key), RecordingProxy.Fault.FORWARD_THEN_503, 1);
            Lease lease = broker.acquire(key, Duration.ofSeconds(10), Duration.ofSeconds(5));
            List<RecordingProxy.Call> posts = proxy.calls().stream()
                    .filter(c -> c.isAcquire() && c.path.endsWith("/" + key)).collect(Collectors.toList());
            equal(2, posts.size(), "one retry: " + posts);
            equal(201, posts.get(0).upstreamStatus, "the first request was granted at the broker");
            equal(requestId(posts.get(0).body), requestId(posts.get(1).body), "the retry kept the request_id");
            equal(fenceOf(posts.get(0).upstreamBody), lease.fence(), "the lease returned is the first grant");
            equal(lease.fence(), fenceOf(get(env.url() + "/locks/" + key).body()), "the broker holds that lease");
            check(other.tryAcquire(key, Duration.ofSeconds(1)).isEmpty(), "no second lease");
            lease.release();
            equal(404, get(env.url() + "/locks/" + key).statusCode(), "nothing left behind after the release");
        }
    }

    static void unavailable(Env env) throws Exception {
        try (RecordingProxy proxy = new RecordingProxy(env.url());
                LockBroker broker = LockBroker.create(proxy.url())) {
            String key = env.key("unavailable");
            proxy.fault(c -> c.isAcquire(), RecordingProxy.Fault.ANSWER_503, Integer.MAX_VALUE);
            try {
                broker.acquire(key, Duration.ofSeconds(5), Duration.ofMillis(600));
                throw new AssertionError("acquired through a broker answering 503");
            } catch (BrokerUnavailableException e) {
                check(e instanceof LockBrokerException, "a LockBrokerException");
                equal(503, e.status(), "status");
            }
            List<RecordingProxy.Call> posts = proxy.calls().stream()
                    .filter(c -> c.isAcquire() && c.path.endsWith("/" + key)).collect(Collectors.toList());
            check(posts.size() >= 2, "retried within the wait: " + posts);
            check(posts.stream().map(c -> requestId(c.body)).distinct().count() == 1, "one request_id: " + posts);
            try {
                broker.tryAcquire(key, Duration.ofSeconds(5));
                throw new AssertionError("tryAcquire through a broker answering 503");
            } catch (BrokerUnavailableException e) {
                equal(503, e.status(), "status");
            }
            equal(404, get(env.url() + "/locks/" + key).statusCode(), "nothing granted");
        }
        int nobody = Processes.freePort();
        try (LockBroker broker = LockBroker.builder().url("http://127.0.0.1:" + nobody)
                .connectTimeout(Duration.ofMillis(500)).build()) {
            try {
                broker.acquire("java-nobody", Duration.ofSeconds(5), Duration.ofMillis(300));
                throw new AssertionError("acquired from nobody");
            } catch (BrokerUnavailableException e) {
                equal(0, e.status(), "no answer");
            }
        }
    }

    static void noRenewAfterClose(Env env) throws Exception {
        try (RecordingProxy proxy = new RecordingProxy(env.url())) {
            LockBroker broker = LockBroker.create(proxy.url());
            String key = env.key("close");
            Duration ttl = Duration.ofMillis(600); // renewed every 200 ms
            Lease lease = broker.acquire(key, ttl, Duration.ZERO);
            proxy.awaitCount(c -> c.isRenew() && c.path.contains("/" + key + "/"), 2, Duration.ofSeconds(5));
            lease.close();
            List<RecordingProxy.Call> calls = proxy.calls();
            long renews = calls.stream().filter(c -> c.isRenew() && c.path.contains("/" + key + "/")).count();
            int lastRenew = -1;
            int delete = -1;
            for (int i = 0; i < calls.size(); i++) {
                if (calls.get(i).isRenew() && calls.get(i).path.contains("/" + key + "/")) {
                    lastRenew = i;
                }
                if ("DELETE".equals(calls.get(i).method) && calls.get(i).path.endsWith("/" + key)) {
                    delete = i;
                }
            }
            check(delete > lastRenew, "the release came after the last renewal: " + calls);
            String key2 = env.key("close-client");
            Lease other = broker.acquire(key2, ttl, Duration.ZERO);
            proxy.awaitCount(c -> c.isRenew() && c.path.contains("/" + key2 + "/"), 2, Duration.ofSeconds(5));
            broker.close();
            check(!other.isHeld(), "closing the client released its leases");
            long renews2 = proxy.count(c -> c.isRenew() && c.path.contains("/" + key2 + "/"));
            // Five renewal periods: a renewer still running would have sent several meanwhile.
            Thread.sleep(1000);
            equal(renews, proxy.count(c -> c.isRenew() && c.path.contains("/" + key + "/")), "no renewal after release");
            equal(renews2, proxy.count(c -> c.isRenew() && c.path.contains("/" + key2 + "/")), "no renewal after close");
            equal(404, get(env.url() + "/locks/" + key2).statusCode(), "released at the broker on close");
        }
    }

    static void tokenNeverShown(Env env) throws Exception {
        try (RecordingProxy proxy = new RecordingProxy(env.url());
                LockBroker broker = LockBroker.builder().url(proxy.url()).authToken("not-shown-either").build()) {
            String key = env.key("token");
            Lease lease = broker.acquire(key, Duration.ofSeconds(5), Duration.ZERO);
            String token = tokenOf(proxy.calls().stream().filter(c -> c.isAcquire()).findFirst().orElseThrow().upstreamBody);
            check(token.length() >= 16, "the broker sent a token");
            check(!lease.toString().contains(token), "toString hides the token: " + lease);
            check(lease.toString().contains(key) && lease.toString().contains(String.valueOf(lease.fence())),
                    "toString shows key and fence: " + lease);
            check(!broker.toString().contains("not-shown-either"), "toString hides the auth token");
            lease.release();
            check(!lease.toString().contains(token), "toString hides the token after release");
        }
    }

    static void givenUpLeavesNothing(Env env) throws Exception {
        try (RecordingProxy proxy = new RecordingProxy(env.url());
                LockBroker broker = LockBroker.create(proxy.url())) {
            String key = env.key("givenup");
            // Every acquire reaches the broker, which grants it (the retries with the same
            // request_id get the same lease), but the client only ever hears 503.
            proxy.fault(c -> c.isAcquire() && c.path.endsWith("/" + key), RecordingProxy.Fault.FORWARD_THEN_503,
                    Integer.MAX_VALUE);
            try {
                broker.acquire(key, Duration.ofSeconds(20), Duration.ofMillis(300));
                throw new AssertionError("returned a lease the client never heard granted");
            } catch (BrokerUnavailableException e) {
                equal(503, e.status(), "status");
            }
            equal(200, get(env.url() + "/locks/" + key).statusCode(), "the broker did grant it");
            proxy.clearFaults();
            // Once the broker's answers get through, the client finds the grant by its
            // request_id and releases it, long before its 20 s ttl.
            proxy.awaitCount(c -> "DELETE".equals(c.method) && c.path.endsWith("/" + key) && c.status == 204, 1,
                    Duration.ofSeconds(10));
            equal(404, get(env.url() + "/locks/" + key).statusCode(), "released, not left behind");
            long ids = proxy.calls().stream().filter(c -> c.isAcquire() && c.path.endsWith("/" + key))
                    .map(c -> requestId(c.body)).distinct().count();
            equal(1L, ids, "every request carried the one request_id");
        }
    }

    static void interruptedWaiter(Env env) throws Exception {
        try (LockBroker one = LockBroker.create(env.url()); LockBroker two = LockBroker.create(env.url())) {
            String key = env.key("interrupted");
            Lease holder = one.acquire(key, Duration.ofSeconds(10), Duration.ZERO);
            long waitersBefore = metric(env.url(), "lockbroker_waiters");
            AtomicReference<Thread> waiter = new AtomicReference<>();
            CompletableFuture<Boolean> interrupted = async(() -> {
                waiter.set(Thread.currentThread());
                try {
                    two.acquire(key, Duration.ofSeconds(20), Duration.ofSeconds(20));
                    return false;
                } catch (LockBrokerException e) {
                    return Thread.currentThread().isInterrupted();
                }
            });
            awaitMetric(env.url(), "lockbroker_waiters", waitersBefore + 1);
            waiter.get().interrupt();
            check(interrupted.get(10, TimeUnit.SECONDS), "acquire gave up, the thread still interrupted");
            holder.release();
            // Whether the broker dropped the abandoned wait or granted it, no lease may stay
            // behind: the key can be taken again long before the waiter's 20 s ttl. (A free
            // key seen once is not enough: the abandoned wait may still be granted right after
            // the release, and then be released by the client's clean-up.)
            long end = System.nanoTime() + TimeUnit.SECONDS.toNanos(8);
            Optional<Lease> again;
            while ((again = one.tryAcquire(key, Duration.ofSeconds(1))).isEmpty()) {
                check(System.nanoTime() < end, "a lease was left behind");
                Thread.sleep(50);
            }
            again.get().release();
        }
    }

    static void noAutoRenew(Env env) throws Exception {
        try (LockBroker broker = LockBroker.create(env.url())) {
            Duration ttl = Duration.ofMillis(800);
            Lease lease = broker.lock(env.key("norenew")).ttl(ttl).autoRenew(false).acquire();
            CompletableFuture<Boolean> lost = new CompletableFuture<>();
            lease.onLost(() -> lost.complete(true));
            lease.renew(); // by hand
            check(lost.get(ttl.toMillis() + 1000, TimeUnit.MILLISECONDS), "lost once its end came");
            check(!lease.isHeld(), "not held");
            try {
                lease.renew();
                throw new AssertionError("renewed a lost lease");
            } catch (LeaseLostException e) {
                check(e.getMessage().contains("lost"), e.getMessage());
            }
            lease.release();
        }
    }

    static void badKey(Env env) throws Exception {
        try (LockBroker broker = LockBroker.create(env.url())) {
            try {
                broker.acquire("no spaces/or slashes", Duration.ofSeconds(1), Duration.ZERO);
                throw new AssertionError("a bad key was accepted");
            } catch (IllegalArgumentException e) {
                check(e.getMessage().contains("no spaces/or slashes") && e.getMessage().contains("A-Z a-z 0-9 . _ - :"),
                        "names the key and the rule: " + e.getMessage());
            }
            try {
                broker.lock("k").owner("x".repeat(129)).acquire();
                throw new AssertionError("an over-long owner was accepted");
            } catch (LockedException | BrokerUnavailableException e) {
                throw new AssertionError("a bad owner reported as " + e.getClass().getSimpleName(), e);
            } catch (LockBrokerException e) {
                equal(400, e.status(), "status");
                equal("invalid_request", e.code(), "code");
                check(e.getMessage().contains("'k'") && e.getMessage().contains(env.url()), "names key and URL: " + e.getMessage());
            }
            try {
                broker.acquire("k", Duration.ZERO, Duration.ZERO);
                throw new AssertionError("a zero ttl was accepted");
            } catch (IllegalArgumentException e) {
                check(e.getMessage().contains("ttl"), e.getMessage());
            }
        }
    }

    static void lostAfterBrokerStopped(Env env) throws Exception {
        try (Processes.Broker own = Processes.Broker.start(null);
                LockBroker broker = LockBroker.builder().url(own.url()).releaseTimeout(Duration.ofMillis(300)).build()) {
            Duration ttl = Duration.ofMillis(2000);
            Lease lease = broker.acquire(env.key("stopped"), ttl, Duration.ZERO);
            CompletableFuture<Long> lost = new CompletableFuture<>();
            lease.onLost(() -> lost.complete(System.nanoTime()));
            own.stop();
            long stopped = System.nanoTime();
            long at = lost.get(ttl.toMillis() + 1000, TimeUnit.MILLISECONDS);
            long after = TimeUnit.NANOSECONDS.toMillis(at - stopped);
            check(after <= ttl.toMillis(), "lost " + after + " ms after the stop, within the ttl");
            check(!lease.isHeld(), "not held");
            lease.release(); // quiet, bounded by the release timeout
        }
    }

    static void storeDown(Env env) throws Exception {
        try (RecordingProxy proxy = new RecordingProxy(env.url());
                // The broker keeps a waiting request through a store outage until its wait_ms
                // ends, then answers 503: short requests, to see several 503s within the wait.
                LockBroker broker = LockBroker.builder().url(proxy.url())
                        .maxWaitPerRequest(Duration.ofMillis(500)).build();
                LockBroker other = LockBroker.create(env.url())) {
            String key = env.key("storedown");
            // A lease held while the store goes away cannot be renewed: lost before its end.
            Duration ttl = Duration.ofMillis(2000);
            Lease held = broker.acquire(env.key("held"), ttl, Duration.ZERO);
            CompletableFuture<Long> lost = new CompletableFuture<>();
            held.onLost(() -> lost.complete(System.nanoTime()));
            env.redis.kill();
            long killed = System.nanoTime();
            CompletableFuture<Lease> acquiring = async(
                    () -> broker.acquire(key, Duration.ofSeconds(10), Duration.ofSeconds(20)));
            proxy.awaitCount(c -> c.isAcquire() && c.path.endsWith("/" + key) && c.upstreamStatus == 503, 2,
                    Duration.ofSeconds(10));
            long lostAfter = TimeUnit.NANOSECONDS.toMillis(lost.get(ttl.toMillis() + 1000, TimeUnit.MILLISECONDS) - killed);
            check(lostAfter <= ttl.toMillis(), "the held lease was lost " + lostAfter + " ms after the store went");
            check(!acquiring.isDone(), "no grant while the store is down");
            env.redis.restart();
            Lease lease = acquiring.get(20, TimeUnit.SECONDS);
            List<RecordingProxy.Call> posts = proxy.calls().stream()
                    .filter(c -> c.isAcquire() && c.path.endsWith("/" + key)).collect(Collectors.toList());
            check(posts.stream().map(c -> requestId(c.body)).distinct().count() == 1, "one request_id: " + posts);
            check(posts.stream().filter(c -> c.upstreamStatus == 503).count() >= 2, "the broker answered 503s");
            equal(lease.fence(), fenceOf(get(env.url() + "/locks/" + key).body()), "the broker holds the lease returned");
            check(other.tryAcquire(key, Duration.ofSeconds(1)).isEmpty(), "no second lease");
            lease.release();
            equal(404, get(env.url() + "/locks/" + key).statusCode(), "nothing left behind");
        }
    }

    // -------------------------------------------------------------------------------------------
    // Helpers

    /** Runs {@code work} on a thread of its own (the common pool may have one thread on a small machine). */
    static <T> CompletableFuture<T> async(java.util.function.Supplier<T> work) {
        CompletableFuture<T> result = new CompletableFuture<>();
        Thread thread = new Thread(() -> {
            try {
                result.complete(work.get());
            } catch (Throwable e) {
                result.completeExceptionally(e);
            }
        }, "test");
        thread.setDaemon(true);
        thread.start();
        return result;
    }

    static void check(boolean ok, String what) {
        if (!ok) {
            throw new AssertionError(what);
        }
    }

    static void equal(Object expected, Object actual, String what) {
        if (!expected.equals(actual)) {
            throw new AssertionError(what + ": expected " + expected + ", got " + actual);
        }
    }

    static HttpResponse<String> send(String method, String url) throws Exception {
        return HTTP.send(HttpRequest.newBuilder(URI.create(url)).method(method, HttpRequest.BodyPublishers.noBody())
                .timeout(Duration.ofSeconds(10)).build(), HttpResponse.BodyHandlers.ofString());
    }

    static HttpResponse<String> get(String url) throws Exception {
        return send("GET", url);
    }

    private static long field(String json, String name) {
        Matcher m = Pattern.compile("\"" + name + "\":(\\d+)").matcher(json);
        if (!m.find()) {
            throw new AssertionError("no " + name + " in " + json);
        }
        return Long.parseLong(m.group(1));
    }

    static long fenceOf(String json) {
        return field(json, "fence");
    }

    static int holders(String json) {
        return json.split("\"fence\"", -1).length - 1;
    }

    static String tokenOf(String json) {
        Matcher m = Pattern.compile("\"token\":\"([^\"]+)\"").matcher(json);
        check(m.find(), "no token in " + json);
        return m.group(1);
    }

    static String requestId(String body) {
        Matcher m = Pattern.compile("\"request_id\":\"([^\"]+)\"").matcher(body);
        check(m.find(), "no request_id in " + body);
        return m.group(1);
    }

    /** A sample of {@code /metrics}, by its full name with labels; 0 when absent. */
    static long metric(String url, String name) throws Exception {
        for (String line : get(url + "/metrics").body().split("\n")) {
            if (line.startsWith(name + " ")) {
                return (long) Double.parseDouble(line.substring(name.length() + 1).trim());
            }
        }
        return 0;
    }

    /** Polls {@code /metrics} until the sample reaches {@code at least}: the broker has no event for it. */
    static void awaitMetric(String url, String name, long atLeast) throws Exception {
        long end = System.nanoTime() + TimeUnit.SECONDS.toNanos(10);
        while (metric(url, name) < atLeast) {
            check(System.nanoTime() < end, name + " did not reach " + atLeast);
            Thread.sleep(20);
        }
    }

    /** Polls {@code /readyz} until 200 (a broker on a new store settles first). */
    static void awaitReady(String url) throws Exception {
        long end = System.nanoTime() + TimeUnit.SECONDS.toNanos(15);
        while (get(url + "/readyz").statusCode() != 200) {
            check(System.nanoTime() < end, url + " did not become ready");
            Thread.sleep(50);
        }
    }
}
