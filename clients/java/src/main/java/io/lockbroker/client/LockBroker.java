package io.lockbroker.client;

import java.time.Duration;
import java.util.ArrayList;
import java.util.List;
import java.util.Optional;
import java.util.Set;
import java.util.concurrent.Callable;
import java.util.concurrent.CompletableFuture;
import java.util.concurrent.CompletionException;
import java.util.concurrent.ConcurrentHashMap;
import java.util.concurrent.TimeUnit;

/**
 * A client of one lockbroker (or of a load balancer in front of several): acquires leases on
 * locks, shared locks and semaphore permits, and keeps them renewed in the background until they
 * are released.
 *
 * <pre>{@code
 * try (LockBroker broker = LockBroker.create("http://127.0.0.1:8080");
 *      Lease lease = broker.acquire("orders:42", Duration.ofSeconds(30), Duration.ofSeconds(5))) {
 *     lease.onLost(() -> log.warn("lost orders:42; stopping"));
 *     writeWithFence(lease.fence());
 * }
 * }</pre>
 *
 * <p>Thread-safe: one instance is meant to be shared by the whole application. A lease belongs
 * to whoever holds the {@link Lease} object, not to a thread: any thread may release it.
 * {@link #close()} stops every background renewal and releases the leases still open.
 */
public final class LockBroker extends SeveralKeysCalls implements AutoCloseable {
    private static final System.Logger LOG = System.getLogger(LockBroker.class.getName());

    final String url;
    final double renewFraction;
    final Duration releaseTimeout;
    final String owner;
    final Workers workers = new Workers();
    /** The leases acquired and not yet released, to release them on {@link #close()}. */
    final Set<Lease> open = ConcurrentHashMap.newKeySet();
    /** The sessions open and not lost, to close them on {@link #close()}. */
    final Set<Session> sessions = ConcurrentHashMap.newKeySet();

    private LockBroker(Builder b) {
        super(new Http(b.url, b.authToken, b.connectTimeout, b.requestTimeout), b.maxWaitPerRequest);
        this.url = http.url;
        this.renewFraction = b.renewFraction;
        this.releaseTimeout = b.releaseTimeout;
        this.owner = b.owner;
    }

    /**
     * A client of the broker at {@code url} ({@code http://host:port}), with every default.
     *
     * @param url the broker's base URL
     * @return the client
     */
    public static LockBroker create(String url) {
        return builder().url(url).build();
    }

    /**
     * A client configured from the environment, with every other default: the broker's URL from
     * {@code LOCKBROKER_URL} (default {@value #DEFAULT_URL}) and the bearer token from
     * {@code LOCKBROKER_AUTH_TOKEN} (none when unset or empty). Not {@code LOCKBROKER_TOKEN}: under
     * {@code lockbroker run} that is the token of the lock the command runs under, not a
     * credential.
     *
     * @return the client
     */
    public static LockBroker fromEnv() {
        return builder().fromEnv().build();
    }

    /** The URL {@link #fromEnv()} uses when {@code LOCKBROKER_URL} is not set. */
    public static final String DEFAULT_URL = "http://127.0.0.1:8080";

    /**
     * A builder of a client; only {@link Builder#url(String)} is required.
     *
     * @return a builder with every default
     */
    public static Builder builder() {
        return new Builder();
    }

    /** Settings of a {@link LockBroker}; only {@link #url(String)} is required. */
    public static final class Builder {
        private String url;
        private String authToken;
        private double renewFraction = 1.0 / 3;
        private Duration connectTimeout = Duration.ofSeconds(2);
        private Duration requestTimeout = Duration.ofSeconds(5);
        private Duration releaseTimeout = Duration.ofSeconds(2);
        private Duration maxWaitPerRequest = Duration.ofSeconds(60);
        private String owner;

        private Builder() {
        }

        /**
         * Takes the URL from {@code LOCKBROKER_URL} (default {@value LockBroker#DEFAULT_URL}) and
         * the bearer token from {@code LOCKBROKER_AUTH_TOKEN} (none when unset or empty); other
         * settings may follow.
         *
         * @return this builder
         */
        public Builder fromEnv() {
            String envUrl = System.getenv("LOCKBROKER_URL");
            String envToken = System.getenv("LOCKBROKER_AUTH_TOKEN");
            this.url = envUrl == null || envUrl.isBlank() ? DEFAULT_URL : envUrl;
            this.authToken = envToken == null || envToken.isEmpty() ? null : envToken;
            return this;
        }

        /**
         * The broker's base URL, {@code http://host:port} or {@code https://...}.
         *
         * @param url the base URL
         * @return this builder
         */
        public Builder url(String url) {
            this.url = url;
            return this;
        }

        /**
         * The bearer token for a broker with auth on (sent as {@code Authorization: Bearer}); optional.
         *
         * @param authToken the bearer token; null for none
         * @return this builder
         */
        public Builder authToken(String authToken) {
            this.authToken = authToken;
            return this;
        }

        /**
         * When a lease is renewed, as a fraction of its ttl (default 1/3: three chances to renew
         * before it ends). Between 0.05 and 0.8.
         *
         * @param fraction the fraction of the ttl after which a lease is renewed
         * @return this builder
         */
        public Builder renewFraction(double fraction) {
            if (!(fraction >= 0.05 && fraction <= 0.8)) {
                throw new IllegalArgumentException("renewFraction must be between 0.05 and 0.8, not " + fraction);
            }
            this.renewFraction = fraction;
            return this;
        }

        /**
         * How long connecting to the broker may take (default 2 s).
         *
         * @param timeout the connect timeout
         * @return this builder
         */
        public Builder connectTimeout(Duration timeout) {
            this.connectTimeout = positive(timeout, "connectTimeout");
            return this;
        }

        /**
         * How long an answer may take beyond the wait the request asked for (default 5 s: the
         * broker's store bound is 2 s by default). A request past it counts as a failed
         * connection and is retried.
         *
         * @param timeout the request timeout
         * @return this builder
         */
        public Builder requestTimeout(Duration timeout) {
            this.requestTimeout = positive(timeout, "requestTimeout");
            return this;
        }

        /**
         * How long {@link Lease#release()} keeps retrying a broker that does not answer (default 2 s).
         *
         * @param timeout the release timeout
         * @return this builder
         */
        public Builder releaseTimeout(Duration timeout) {
            this.releaseTimeout = positive(timeout, "releaseTimeout");
            return this;
        }

        /**
         * The longest {@code wait_ms} one request asks for (default 60 s, the broker's default
         * {@code max_wait_ms}); a longer wait is made of several requests.
         *
         * @param max the longest wait one request asks for
         * @return this builder
         */
        public Builder maxWaitPerRequest(Duration max) {
            this.maxWaitPerRequest = positive(max, "maxWaitPerRequest");
            return this;
        }

        /**
         * The {@code owner} label every acquire sends unless it names its own (shown by {@code GET}, for people).
         *
         * @param owner the label (at most 128 characters)
         * @return this builder
         */
        public Builder owner(String owner) {
            this.owner = owner;
            return this;
        }

        /**
         * The client, with these settings.
         *
         * @return the client
         * @throws IllegalArgumentException when the URL is missing or not http(s)
         */
        public LockBroker build() {
            return new LockBroker(this);
        }
    }

    // ---------------------------------------------------------------------------------------
    // Acquiring

    /**
     * Takes the exclusive lock on {@code key} for {@code ttl}, waiting up to {@code wait} while
     * someone else holds it (the broker does the waiting). The lease is renewed in the background
     * until it is released.
     *
     * @param key the lock's key (1 to 200 of {@code A-Z a-z 0-9 . _ - :})
     * @param ttl the lease's length, asked again by each renewal
     * @param wait how long to wait while someone else holds it
     * @return the lease, held and renewed
     * @throws LockedException when someone else still held it after {@code wait}
     * @throws BrokerUnavailableException when the broker could not be reached or kept answering
     *     503 until {@code wait} ran out
     * @throws LockBrokerException for any other refusal (auth: {@code 401}/{@code 403}) or an
     *     answer no retry would change (a 5xx other than 502, 503, 504: not the broker's own)
     * @throws IllegalArgumentException when the key breaks the key rule or the ttl is under 1 ms
     */
    public Lease acquire(String key, Duration ttl, Duration wait) {
        return lock(key).ttl(ttl).maxWait(wait).acquire();
    }

    /**
     * Takes the exclusive lock on {@code key} if it is free now ({@code wait_ms=0}); empty when
     * someone else holds it.
     *
     * @param key the lock's key
     * @param ttl the lease's length
     * @return the lease; empty when someone else holds it
     * @throws BrokerUnavailableException when the broker could not be reached or answered 503
     */
    public Optional<Lease> tryAcquire(String key, Duration ttl) {
        return lock(key).ttl(ttl).tryAcquire();
    }

    /**
     * A shared (read) lease on {@code key}: any number at once, never together with an exclusive one.
     *
     * @param key the lock's key
     * @param ttl the lease's length
     * @param wait how long to wait while an exclusive lease holds it
     * @return the shared lease
     */
    public Lease acquireShared(String key, Duration ttl, Duration wait) {
        return lock(key).shared().ttl(ttl).maxWait(wait).acquire();
    }

    /**
     * A shared lease on {@code key} if one can be had now.
     *
     * @param key the lock's key
     * @param ttl the lease's length
     * @return the shared lease; empty when an exclusive lease holds it
     */
    public Optional<Lease> tryAcquireShared(String key, Duration ttl) {
        return lock(key).shared().ttl(ttl).tryAcquire();
    }

    /**
     * One of {@code limit} permits of the semaphore {@code key}, waiting up to {@code wait}.
     *
     * @param key the semaphore's key
     * @param limit how many permits the semaphore has (every holder must give the same)
     * @param ttl the lease's length
     * @param wait how long to wait while every permit is taken
     * @return the permit's lease
     */
    public Lease acquirePermit(String key, int limit, Duration ttl, Duration wait) {
        return semaphore(key, limit).ttl(ttl).maxWait(wait).acquire();
    }

    /**
     * One of {@code limit} permits of the semaphore {@code key} if one is free now.
     *
     * @param key the semaphore's key
     * @param limit how many permits the semaphore has
     * @param ttl the lease's length
     * @return the permit's lease; empty when every permit is taken
     */
    public Optional<Lease> tryAcquirePermit(String key, int limit, Duration ttl) {
        return semaphore(key, limit).ttl(ttl).tryAcquire();
    }

    /**
     * A request for the lock on {@code key}, to set more than the shortcuts do (owner, shared, no auto-renew).
     *
     * @param key the lock's key
     * @return the request, to set and then acquire
     */
    public LockRequest lock(String key) {
        return new LockRequest(this, key, Lease.Kind.EXCLUSIVE, 0);
    }

    /**
     * A request for one of {@code limit} permits of the semaphore {@code key} (1..=10000).
     *
     * @param key the semaphore's key
     * @param limit how many permits it has
     * @return the request, to set and then acquire
     */
    public LockRequest semaphore(String key, int limit) {
        if (limit < 1) {
            throw new IllegalArgumentException("a semaphore's limit must be at least 1, not " + limit);
        }
        return new LockRequest(this, key, Lease.Kind.PERMIT, limit);
    }

    /** The acquire loop behind every shortcut: see the class comment of {@link LockRequest}. */
    Lease acquire(LockRequest r) {
        return new Acquisition(this).acquire(r);
    }

    // ---------------------------------------------------------------------------------------
    // Sessions

    /**
     * Opens a session ({@code POST /sessions}) with no lock delay: one keep-alive, every
     * {@code ttl}/3 on this client's renewal timer, for every lease taken under it with
     * {@link Session#acquire(String, Duration)}. See {@link Session}.
     *
     * @param ttl how long the session (and every lease under it) lives after its last keep-alive
     * @return the session, alive and kept alive until closed or lost
     * @throws BrokerUnavailableException when the broker could not be reached or kept answering 503
     * @throws LockBrokerException for any other refusal (auth, a ttl over the broker's bound)
     */
    public Session openSession(Duration ttl) {
        return openSession(ttl, Duration.ZERO);
    }

    /**
     * Opens a session whose keys stay locked for {@code lockDelay} after it ends by expiry (its
     * keep-alives stopped: the node died, or lost the broker), so that a node that learnt of its
     * loss late does not overlap the next holder. A {@link Session#close()} has no delay.
     *
     * @param ttl how long the session lives after its last keep-alive
     * @param lockDelay 0 to 60 s
     * @return the session
     * @throws BrokerUnavailableException when the broker could not be reached or kept answering 503
     * @throws LockBrokerException for any other refusal
     */
    public Session openSession(Duration ttl, Duration lockDelay) {
        return Session.open(this, ttl, lockDelay);
    }

    // ---------------------------------------------------------------------------------------
    // Work under a lease

    /**
     * Runs {@code work} on the calling thread under an exclusive lease on {@code key} (acquired
     * as {@link #acquire(String, Duration, Duration)} does, renewed while it runs), and releases
     * the lease on the way out, however the work ends. If the lease is lost while the work runs,
     * the calling thread is interrupted (work blocked in an interruptible call, or checking
     * {@link Thread#isInterrupted()}, stops) and this throws {@link LeaseLostException}, whatever
     * the work returned; the interrupt this caused is cleared before it returns.
     *
     * <pre>{@code
     * int rows = broker.withLease("orders:42", Duration.ofSeconds(30), Duration.ofSeconds(5),
     *         () -> db.updateOrder(42));
     * }</pre>
     *
     * @param <T> what the work returns
     * @param key the lock to hold while the work runs
     * @param ttl the lease's ttl (it is renewed while the work runs)
     * @param wait how long to wait for the lock while someone else holds it
     * @param work what to run under the lease
     * @return what {@code work} returned
     * @throws LockedException when someone else still held the lock after {@code wait}
     * @throws BrokerUnavailableException when the broker could not be reached to acquire it
     * @throws LeaseLostException when the lease was lost (or the client closed) before the work
     *     was done; the work's own exception, if it threw one, is the cause
     * @throws CompletionException wrapping a checked exception the work threw (an unchecked one
     *     is thrown as it is)
     */
    public <T> T withLease(String key, Duration ttl, Duration wait, Callable<T> work) {
        if (work == null) {
            throw new IllegalArgumentException("work is null");
        }
        return WorkUnderLease.run(acquire(key, ttl, wait), key, work);
    }

    static void warn(String message) {
        LOG.log(System.Logger.Level.WARNING, message);
    }

    /**
     * The base URL this client talks to.
     *
     * @return the URL, without a trailing slash
     */
    public String url() {
        return url;
    }

    /**
     * Stops every background renewal and keep-alive for good, releases the leases still open
     * and closes the sessions (each bounded by the release timeout). Idempotent.
     */
    @Override
    public void close() {
        if (closed) {
            return;
        }
        closed = true;
        List<CompletableFuture<Void>> releases = new ArrayList<>();
        for (Lease lease : open) {
            releases.add(CompletableFuture.runAsync(lease::release, workers.background));
        }
        for (Session session : sessions) {
            releases.add(CompletableFuture.runAsync(session::close, workers.background));
        }
        try {
            CompletableFuture.allOf(releases.toArray(new CompletableFuture<?>[0]))
                    .get(releaseTimeout.plus(http.requestTimeout).toMillis(), TimeUnit.MILLISECONDS);
        } catch (InterruptedException e) {
            Thread.currentThread().interrupt();
        } catch (Exception e) {
            warn("not every lease was released on close: " + e);
        }
        workers.shutdown();
        http.close();
    }

    @Override
    public String toString() {
        return "LockBroker[" + url + (closed ? ", closed" : "") + "]";
    }
}
