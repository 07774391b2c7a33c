package io.lockbroker.client.tests;

import static io.lockbroker.client.tests.ClientTests.async;
import static io.lockbroker.client.tests.ClientTests.check;
import static io.lockbroker.client.tests.ClientTests.equal;
import static io.lockbroker.client.tests.ClientTests.send;

import io.lockbroker.client.KeyView;
import io.lockbroker.client.KeyWatcher;
import io.lockbroker.client.Lease;
import io.lockbroker.client.Leadership;
import io.lockbroker.client.LockBroker;
import java.time.Duration;
import java.util.ArrayList;
import java.util.Collections;
import java.util.List;
import java.util.Optional;
import java.util.concurrent.BlockingQueue;
import java.util.concurrent.CompletableFuture;
import java.util.concurrent.CountDownLatch;
import java.util.concurrent.LinkedBlockingQueue;
import java.util.concurrent.TimeUnit;
import java.util.concurrent.atomic.AtomicBoolean;
import java.util.concurrent.atomic.AtomicInteger;

/** Tests of watch, follow and {@link Leadership}, against the same brokers as {@link ClientTests}. */
final class WatchTests {
    private WatchTests() {
    }

    /** A watch sees a grant and a release, and an unchanged fence times out with changed=false. */
    static void watchSeesGrantAndRelease(ClientTests.Env env) throws Exception {
        try (LockBroker broker = LockBroker.create(env.url())) {
            String key = env.key("watch");
            KeyView free = broker.watch(key, 0, Duration.ofMillis(200));
            check(!free.changed(), "a free key watched as free times out unchanged: " + free);
            check(!free.isHeld() && free.fence() == 0, "free: " + free);

            CompletableFuture<KeyView> granted = async(() -> broker.watch(key, 0, Duration.ofSeconds(10)));
            Lease lease = broker.lock(key).owner("watched-1").ttl(Duration.ofSeconds(10)).acquire();
            KeyView held = granted.get(10, TimeUnit.SECONDS);
            check(held.changed() && held.isHeld(), "the grant is seen: " + held);
            equal(lease.fence(), held.fence(), "the watched fence");
            equal(Optional.of("watched-1"), held.owner(), "the watched owner");
            equal(Optional.of("exclusive"), held.mode(), "the watched mode");
            check(held.expiresAt().isPresent(), "the watched end");
            check(!held.toString().contains("token"), "no token shown: " + held);

            KeyView same = broker.watch(key, lease.fence(), Duration.ofMillis(300));
            check(!same.changed(), "an unchanged fence times out unchanged: " + same);
            equal(lease.fence(), same.fence(), "the unchanged view's fence");

            CompletableFuture<KeyView> released = async(() -> broker.watch(key, lease.fence(), Duration.ofSeconds(10)));
            lease.release();
            KeyView after = released.get(10, TimeUnit.SECONDS);
            check(after.changed() && !after.isHeld() && after.fence() == 0, "the release is seen: " + after);

            String sem = env.key("watch-sem");
            try (Lease permit = broker.acquirePermit(sem, 2, Duration.ofSeconds(10), Duration.ZERO)) {
                KeyView view = broker.watchSemaphore(sem, 0, Duration.ofSeconds(5));
                check(view.changed() && view.isHeld(), "a permit is seen: " + view);
                equal(permit.fence(), view.fence(), "the semaphore's fence");
                equal(1, view.holders(), "permits taken");
            }
            try {
                broker.watch("no spaces/or slashes", 0, Duration.ZERO);
                throw new AssertionError("a bad key was watched");
            } catch (IllegalArgumentException e) {
                check(e.getMessage().contains("A-Z a-z 0-9 . _ - :"), "a bad key's error: " + e.getMessage());
            }
            try {
                broker.follow("no spaces/or slashes", view -> { });
                throw new AssertionError("a bad key was followed");
            } catch (IllegalArgumentException e) {
                check(e.getMessage().contains("A-Z a-z 0-9 . _ - :"), "a bad key's error, followed: " + e.getMessage());
            }
        }
    }

    /** Following a key yields its view, then each change once, in order. */
    static void followYieldsEachChangeOnce(ClientTests.Env env) throws Exception {
        try (LockBroker broker = LockBroker.create(env.url())) {
            String key = env.key("follow");
            BlockingQueue<KeyView> views = new LinkedBlockingQueue<>();
            KeyWatcher watcher = broker.follow(key, views::add);
            KeyView first = next(views);
            check(!first.isHeld(), "first, the key as it is: free: " + first);
            for (String owner : List.of("a", "b", "c")) {
                Lease lease = broker.lock(key).owner(owner).ttl(Duration.ofSeconds(10)).acquire();
                KeyView held = next(views);
                check(held.isHeld() && held.fence() == lease.fence(), "the grant to " + owner + ": " + held);
                equal(Optional.of(owner), held.owner(), "the holder");
                lease.renew(); // not a change: nothing is delivered for it
                lease.release();
                KeyView free = next(views);
                check(!free.isHeld(), "the release by " + owner + ": " + free);
            }
            watcher.close();
            check(views.isEmpty(), "no change delivered twice: " + views);
        }
    }

    private static KeyView next(BlockingQueue<KeyView> views) throws InterruptedException {
        KeyView view = views.poll(10, TimeUnit.SECONDS);
        check(view != null, "no view within 10 s");
        return view;
    }

    /** A candidate's events, and the one it is at. */
    private static final class Candidate {
        final List<String> events = Collections.synchronizedList(new ArrayList<>());
        final CountDownLatch elected = new CountDownLatch(1);
        final Leadership leadership;

        Candidate(LockBroker broker, String key, String name, CountDownLatch anyElected) {
            leadership = new Leadership(broker, key, name, Duration.ofSeconds(5));
            leadership.onElected(() -> {
                events.add("elected");
                elected.countDown();
                anyElected.countDown();
            });
            leadership.onRevoked(() -> events.add("revoked"));
        }
    }

    /**
     * Two candidates on one key (each with its own client): exactly one leads, the other names
     * it; when the leader closes, its onRevoked has run and the other is elected at once.
     */
    static void oneLeaderThenHandover(ClientTests.Env env) throws Exception {
        try (LockBroker one = LockBroker.create(env.url()); LockBroker two = LockBroker.create(env.url())) {
            String key = env.key("leader");
            CountDownLatch anyElected = new CountDownLatch(1);
            CompletableFuture<Candidate> startA = async(() -> new Candidate(one, key, "node-a", anyElected));
            CompletableFuture<Candidate> startB = async(() -> new Candidate(two, key, "node-b", anyElected));
            Candidate a = startA.get(10, TimeUnit.SECONDS);
            Candidate b = startB.get(10, TimeUnit.SECONDS);
            AtomicBoolean sampling = new AtomicBoolean(true);
            AtomicInteger overlaps = new AtomicInteger();
            CompletableFuture<Integer> sampler = async(() -> {
                int samples = 0;
                while (sampling.get()) {
                    // Two reads are two instants: a handover between them would look like two
                    // leaders. Both at once is one leading before and after the other's read.
                    boolean a1 = a.leadership.isLeader();
                    boolean b1 = b.leadership.isLeader();
                    boolean a2 = a.leadership.isLeader();
                    boolean b2 = b.leadership.isLeader();
                    if (a1 && b1 && a2 || b1 && a2 && b2) {
                        overlaps.incrementAndGet();
                    }
                    samples++;
                    Thread.onSpinWait();
                }
                return samples;
            });
            check(anyElected.await(10, TimeUnit.SECONDS), "nobody elected within 10 s");
            Candidate leader = a.leadership.isLeader() ? a : b;
            Candidate follower = leader == a ? b : a;
            check(leader.leadership.isLeader() && !follower.leadership.isLeader(), "exactly one leads");
            String leaderName = leader.leadership.name();
            equal(Optional.of(leaderName), leader.leadership.leader(), "the leader names itself");
            awaitLeader(follower.leadership, leaderName);
            equal(List.of("elected"), leader.events, "the leader's events");
            equal(List.of(), follower.events, "the follower's events");

            leader.leadership.close();
            // close() returns after the onRevoked callbacks have run.
            equal(List.of("elected", "revoked"), leader.events, "the closed leader's events");
            check(!leader.leadership.isLeader(), "closed: no longer leads");
            check(follower.elected.await(5, TimeUnit.SECONDS), "the follower not elected after the handover");
            check(follower.leadership.isLeader(), "the follower leads");
            equal(Optional.of(follower.leadership.name()), follower.leadership.leader(), "the new leader's name");
            check(follower.leadership.fence().isPresent(), "the new leader has a fence");

            follower.leadership.close();
            sampling.set(false);
            check(sampler.get(10, TimeUnit.SECONDS) > 0, "the sampler ran");
            equal(0, overlaps.get(), "samples with two leaders");
            equal(List.of("elected", "revoked"), follower.events, "the second leader's events");
            equal(List.of("elected", "revoked"), leader.events, "the first leader's events, after");
            leader.leadership.close(); // idempotent
        }
    }

    /** A leader whose lease is force-released is revoked, then campaigns and is elected again. */
    static void revokedWhenLeaseLost(ClientTests.Env env) throws Exception {
        try (LockBroker broker = LockBroker.builder().url(env.url()).renewFraction(0.2).build()) {
            String key = env.key("revoked");
            CountDownLatch elected = new CountDownLatch(2);
            CountDownLatch revoked = new CountDownLatch(1);
            List<String> events = Collections.synchronizedList(new ArrayList<>());
            AtomicInteger leadingWhenRevoked = new AtomicInteger();
            try (Leadership leadership = new Leadership(broker, key, "node-r", Duration.ofSeconds(2))) {
                leadership.onRevoked(() -> {
                    events.add("revoked");
                    if (leadership.isLeader()) {
                        leadingWhenRevoked.incrementAndGet();
                    }
                    revoked.countDown();
                });
                leadership.onElected(() -> {
                    events.add("elected");
                    elected.countDown();
                });
                long firstFence = awaitFence(leadership);
                equal(204, send("DELETE", env.url() + "/locks/" + key + "?force=true").statusCode(), "force release");
                check(revoked.await(10, TimeUnit.SECONDS), "not revoked within 10 s of a force release");
                check(elected.await(10, TimeUnit.SECONDS), "not elected again");
                equal(List.of("elected", "revoked", "elected"), events, "events in order");
                equal(0, leadingWhenRevoked.get(), "onRevoked ran while isLeader() was still true");
                long second = awaitFence(leadership);
                check(second > firstFence, "the new term's fence is greater");
            }
            equal(List.of("elected", "revoked", "elected", "revoked"), events, "events after close");
        }
    }

    /** Closing the client under a leader releases its lease: that ends the term, with onRevoked. */
    static void revokedWhenClientCloses(ClientTests.Env env) throws Exception {
        String key = env.key("client-closed");
        CountDownLatch revoked = new CountDownLatch(1);
        LockBroker broker = LockBroker.create(env.url());
        Leadership leadership = new Leadership(broker, key, "node-c", Duration.ofSeconds(10));
        leadership.onRevoked(revoked::countDown);
        awaitFence(leadership);
        broker.close();
        check(revoked.await(10, TimeUnit.SECONDS), "not revoked within 10 s of closing its client");
        check(!leadership.isLeader(), "no longer leads");
        equal(404, ClientTests.get(env.url() + "/locks/" + key).statusCode(), "released at the broker");
        leadership.close();
        equal(0L, revoked.getCount(), "revoked once");
    }

    private static long awaitFence(Leadership leadership) throws InterruptedException {
        long end = System.nanoTime() + TimeUnit.SECONDS.toNanos(10);
        while (leadership.fence().isEmpty()) {
            check(System.nanoTime() < end, "not leading within 10 s");
            Thread.sleep(10);
        }
        return leadership.fence().get();
    }

    /** Polls leader(): it follows a watch, whose answer the candidate has no event for. */
    private static void awaitLeader(Leadership leadership, String name) throws InterruptedException {
        long end = System.nanoTime() + TimeUnit.SECONDS.toNanos(10);
        while (!leadership.leader().equals(Optional.of(name))) {
            check(System.nanoTime() < end, "leader() did not report " + name + ": " + leadership.leader());
            Thread.sleep(10);
        }
    }
}
