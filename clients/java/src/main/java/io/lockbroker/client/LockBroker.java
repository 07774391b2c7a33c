package io.lockbroker.client;

import java.io.IOException;
import java.net.URI;
import java.net.URLEncoder;
import java.net.http.HttpClient;
import java.net.http.HttpRequest;
import java.net.http.HttpResponse;
import java.nio.charset.StandardCharsets;
import java.security.SecureRandom;
import java.time.Duration;
import java.util.ArrayList;
import java.util.Base64;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;
import java.util.Optional;
import java.util.Set;
import java.util.concurrent.Callable;
import java.util.concurrent.CompletableFuture;
import java.util.concurrent.CompletionException;
import java.util.concurrent.ConcurrentHashMap;
import java.util.concurrent.ExecutorService;
import java.util.concurrent.Executors;
import java.util.concurrent.ScheduledThreadPoolExecutor;
import java.util.concurrent.ThreadFactory;
import java.util.concurrent.TimeUnit;
import java.util.concurrent.atomic.AtomicInteger;

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
public final class LockBroker implements AutoCloseable {
    private static final System.Logger LOG = System.getLogger(LockBroker.class.getName());
    private static final SecureRandom RANDOM = new SecureRandom();

    final String url;
    private final String authToken;
    final double renewFraction;
    final Duration requestTimeout;
    final Duration releaseTimeout;
    final Duration maxWaitPerRequest;
    private final String owner;
    final HttpClient http;
    private final ExecutorService httpThreads;
    /** Times renewals and loss checks; its tasks only start requests, never block. */
    final ScheduledThreadPoolExecutor timer;
    /** Runs lost-lease callbacks, so that a slow one holds up no renewal. */
    final ExecutorService callbacks;
    /** Blocking background work: releasing grants the client could not confirm. */
    final ExecutorService background;
    /** The leases acquired and not yet released, to release them on {@link #close()}. */
    final Set<Lease> open = ConcurrentHashMap.newKeySet();
    private volatile boolean closed;

    private LockBroker(Builder b) {
        if (b.url == null || b.url.isBlank()) {
            throw new IllegalArgumentException("the broker's url is required, e.g. http://127.0.0.1:8080");
        }
        String u = b.url.strip();
        while (u.endsWith("/")) {
            u = u.substring(0, u.length() - 1);
        }
        URI uri = URI.create(u);
        if (!"http".equals(uri.getScheme()) && !"https".equals(uri.getScheme())) {
            throw new IllegalArgumentException("the broker's url must start with http:// or https://, not: " + u);
        }
        this.url = u;
        this.authToken = b.authToken;
        this.renewFraction = b.renewFraction;
        this.requestTimeout = b.requestTimeout;
        this.releaseTimeout = b.releaseTimeout;
        this.maxWaitPerRequest = b.maxWaitPerRequest;
        this.owner = b.owner;
        this.httpThreads = Executors.newCachedThreadPool(daemon("lockbroker-http"));
        this.http = HttpClient.newBuilder()
                .version(HttpClient.Version.HTTP_1_1)
                .connectTimeout(b.connectTimeout)
                .executor(httpThreads)
                .build();
        this.timer = new ScheduledThreadPoolExecutor(1, daemon("lockbroker-renew"));
        this.timer.setRemoveOnCancelPolicy(true);
        this.callbacks = Executors.newSingleThreadExecutor(daemon("lockbroker-lost-callbacks"));
        this.background = Executors.newCachedThreadPool(daemon("lockbroker-cleanup"));
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
        if (closed) {
            throw new IllegalStateException("this LockBroker is closed");
        }
        String path = r.path();
        long ttlMs = millis(r.ttl, "ttl", 1);
        // Past a year, a wait is "for ever" (and nanoTime arithmetic stays clear of overflow).
        long waitMs = Math.min(millis(r.wait, "wait", 0), TimeUnit.DAYS.toMillis(365));
        long start = System.nanoTime();
        long deadline = start + TimeUnit.MILLISECONDS.toNanos(waitMs);
        String requestId = newRequestId();
        // Whether a request since the last definite "not granted" may have been granted (its
        // answer was a 503 or never came), and the send time of the first such request: a lease
        // granted then ends no earlier than this plus the ttl.
        boolean unsure = false;
        long unsureSince = 0;
        Backoff backoff = new Backoff();
        boolean firstAttempt = true;
        BrokerUnavailableException trouble = null;
        while (true) {
            Long retryAfter = null;
            long sent = System.nanoTime();
            long askWait = Math.min(Math.max(0, TimeUnit.NANOSECONDS.toMillis(deadline - sent)),
                    maxWaitPerRequest.toMillis());
            boolean retried = unsure;
            if (!unsure) {
                unsure = true;
                unsureSince = sent;
            }
            Map<String, Object> body = r.body(ttlMs, askWait, requestId, owner);
            HttpResponse<String> response;
            try {
                response = send("POST", path, Json.object(body), null,
                        Duration.ofMillis(askWait).plus(requestTimeout));
            } catch (IOException e) {
                trouble = unreachable("acquire '" + r.key + "'", e);
                response = null;
            } catch (InterruptedException e) {
                // The request may still be parked at the broker (JDKs before 16 do not abort it):
                // nothing it says is conclusive before it would have ended by itself.
                cleanUpAfter(path, body, unsureSince, ttlMs,
                        sent + TimeUnit.MILLISECONDS.toNanos(askWait) + requestTimeout.toNanos());
                Thread.currentThread().interrupt();
                throw new LockBrokerException("interrupted while acquiring '" + r.key + "'", e);
            }
            if (response != null) {
                int status = response.statusCode();
                Map<String, Object> answer = Json.parseObject(response.body());
                String code = string(answer, "error");
                if (status == 201) {
                    // The grant was made after `sent` (or, on a retry, after the first request
                    // that may have made it): its end is no earlier than that plus the ttl.
                    Lease lease = new Lease(this, r, answer, retried ? unsureSince : sent, ttlMs);
                    if (lease.needsConfirmation() && !lease.confirm(deadline)) {
                        // Granted after a long wait or on a retry, so possibly nearly over, and
                        // no renewal confirmed it: not returned; released in the background.
                        lease.abandon();
                        trouble = new BrokerUnavailableException("cannot acquire '" + r.key + "' at " + url
                                + ": the broker granted it but did not confirm it with a renewal", 0, null, null);
                        unsure = false;
                        requestId = newRequestId();
                    } else {
                        open.add(lease);
                        lease.start();
                        if (closed) {
                            lease.release();
                            throw new IllegalStateException("this LockBroker was closed while acquiring");
                        }
                        return lease;
                    }
                } else if (status == 409 && "locked".equals(code)) {
                    unsure = false;
                    if (System.nanoTime() - deadline < 0 && askWait > 0) {
                        continue; // the wait was split over several requests
                    }
                    Long retryMs = number(answer, "retry_after_ms");
                    throw new LockedException(r.key, retryMs == null ? null : Duration.ofMillis(retryMs), url);
                } else if (retryable(status)) {
                    trouble = unavailable("acquire '" + r.key + "'", response, answer);
                    retryAfter = retryAfterMs(response);
                } else {
                    // A 4xx refused this request, but an earlier one may have been granted; a 5xx
                    // the broker never sends (a proxy's) leaves even this one's outcome unknown.
                    if (retried || status >= 500) {
                        cleanUpAfter(path, body, unsureSince, ttlMs, System.nanoTime());
                    }
                    throw refusal("acquire '" + r.key + "'", response, answer);
                }
            }
            // Retry with the same request_id (a grant made meanwhile comes back, not a second
            // one), for as long as the caller's wait lasts.
            long left = deadline - System.nanoTime();
            boolean staleConnection = firstAttempt && trouble.status() == 0
                    && trouble.getCause() instanceof IOException
                    && !(trouble.getCause() instanceof java.net.http.HttpTimeoutException);
            firstAttempt = false;
            if (left <= 0 && !staleConnection) {
                if (unsure) {
                    cleanUpAfter(path, r.body(ttlMs, 0, requestId, owner), unsureSince, ttlMs, System.nanoTime());
                }
                throw trouble;
            }
            // A kept-alive connection the broker had closed: try a fresh one at once. Otherwise
            // pause, but not past the end of the wait: the last try comes then, with wait_ms=0.
            if (!staleConnection && !backoff.sleep(retryAfter, deadline)) {
                if (unsure) {
                    cleanUpAfter(path, r.body(ttlMs, 0, requestId, owner), unsureSince, ttlMs, System.nanoTime());
                }
                throw new LockBrokerException("interrupted while acquiring '" + r.key + "'", new InterruptedException());
            }
        }
    }

    /**
     * After giving up on an acquire whose last requests may have been granted: asks again with
     * the same request_id (and no wait) until any such grant would have ended, and releases what
     * comes back, so that no lease is left that nobody holds the token of. A "locked" answer
     * means none of ours is live only once no request of ours can still be waiting at the
     * broker ({@code conclusiveAfter}); before that it keeps asking.
     */
    private void cleanUpAfter(String path, Map<String, Object> body, long unsureSince, long ttlMs,
            long conclusiveAfter) {
        if (closed) {
            return;
        }
        Map<String, Object> noWait = new LinkedHashMap<>(body);
        noWait.put("wait_ms", 0L);
        long ttl = TimeUnit.MILLISECONDS.toNanos(ttlMs);
        long until = conclusiveAfter - unsureSince > 0 ? conclusiveAfter + ttl : unsureSince + ttl;
        inBackground(() -> {
            Backoff backoff = new Backoff();
            while (!closed && System.nanoTime() - until < 0) {
                Long retryAfter = null;
                try {
                    HttpResponse<String> response = send("POST", path, Json.object(noWait), null, requestTimeout);
                    int status = response.statusCode();
                    if (status == 201) {
                        String token = string(Json.parseObject(response.body()), "token");
                        if (token != null) {
                            send("DELETE", path, null, token, requestTimeout);
                        }
                        return;
                    }
                    boolean conclusive = System.nanoTime() - conclusiveAfter >= 0;
                    if (status == 409 && conclusive || status != 409 && !retryable(status)) {
                        return; // not ours: someone else holds it, or nothing to find (or to ask)
                    }
                    retryAfter = retryAfterMs(response);
                } catch (IOException e) {
                    // still unreachable; try again while a lost grant could still be live
                } catch (InterruptedException e) {
                    return;
                }
                if (!backoff.sleep(retryAfter, until)) {
                    return;
                }
            }
        });
    }

    /** Runs blocking clean-up work on a background thread; nothing once the client is closed. */
    void inBackground(Runnable work) {
        try {
            background.execute(work);
        } catch (java.util.concurrent.RejectedExecutionException e) {
            // closed meanwhile: close() released what it could
        }
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
        Lease lease = acquire(key, ttl, wait);
        WorkGuard guard = new WorkGuard(Thread.currentThread());
        T result = null;
        Throwable failure = null;
        boolean lost;
        try {
            lease.onLost(guard); // at once if already lost: the work then starts interrupted
            try {
                result = work.call();
            } catch (Exception | Error e) {
                failure = e;
            }
        } finally {
            lost = guard.finish() | !lease.isHeld();
            lease.release();
        }
        if (failure instanceof Error) {
            throw (Error) failure;
        }
        if (lost) {
            throw new LeaseLostException("the work under '" + key + "' was not done while its lease was held: the lease "
                    + lease.lostReason().map(r -> "was lost: " + r).orElse("was released (the client was closed)"),
                    failure);
        }
        if (failure instanceof RuntimeException) {
            throw (RuntimeException) failure;
        }
        if (failure != null) {
            throw new CompletionException(failure);
        }
        return result;
    }

    /** Interrupts the work's thread when its lease is lost, but only while the work runs. */
    private static final class WorkGuard implements Runnable {
        private final Thread worker;
        private boolean running = true;
        private boolean interrupted;

        WorkGuard(Thread worker) {
            this.worker = worker;
        }

        @Override
        public synchronized void run() {
            if (running) {
                interrupted = true;
                worker.interrupt();
            }
        }

        /** The work is over: no interrupt from now on, and the one this caused is cleared. */
        synchronized boolean finish() {
            running = false;
            if (interrupted) {
                Thread.interrupted();
            }
            return interrupted;
        }
    }

    // ---------------------------------------------------------------------------------------
    // Inspecting, listing, force release

    /**
     * Who holds the lock {@code key} now ({@code GET /locks/{key}}): a view with its fence,
     * owner, mode and end, or a free view ({@link KeyView#isHeld()} false, fence 0) when nobody
     * does. Never a token. {@code 503}s and failed connections are retried for up to the request
     * timeout.
     *
     * @param key the lock's key
     * @return the key's view now ({@link KeyView#changed()} is false)
     * @throws BrokerUnavailableException when the broker could not be reached or kept answering 503
     * @throws LockBrokerException for any other refusal (auth)
     */
    public KeyView inspect(String key) {
        return inspect("/locks/", key);
    }

    /**
     * {@link #inspect(String)} for the semaphore {@code key}: its limit, permits taken and highest fence.
     *
     * @param key the semaphore's key
     * @return the semaphore's view now
     */
    public KeyView inspectSemaphore(String key) {
        return inspect("/semaphores/", key);
    }

    private KeyView inspect(String space, String key) {
        Keys.check(key);
        String what = "inspect '" + key + "'";
        HttpResponse<String> response = call("GET", space + key, what);
        Map<String, Object> answer = Json.parseObject(response.body());
        if (response.statusCode() == 200) {
            return KeyView.of(key, true, answer);
        }
        if (response.statusCode() == 404 && "not_held".equals(string(answer, "error"))) {
            return KeyView.of(key, false, answer);
        }
        throw refusal(what, response, answer);
    }

    /**
     * One page of the held locks whose keys start with {@code prefix}, in key order
     * ({@code GET /locks?prefix=&limit=&cursor=}). Never a token.
     *
     * @param prefix the start of the keys to list ({@code ""}: every key)
     * @param limit at most this many on the page (1 to 1000)
     * @param cursor {@code null} for the first page, else the previous page's {@link KeyListing#nextCursor()}
     * @return the page
     * @throws BrokerUnavailableException when the broker could not be reached or kept answering 503
     * @throws LockBrokerException for any other refusal (auth)
     */
    public KeyListing listLocks(String prefix, int limit, String cursor) {
        return list("/locks", "locks", prefix, limit, cursor);
    }

    /**
     * Every held lock whose key starts with {@code prefix}, in key order: every page of
     * {@link #listLocks(String, int, String)}.
     *
     * @param prefix the start of the keys to list ({@code ""}: every key)
     * @return the locks' views
     */
    public List<KeyView> listLocks(String prefix) {
        return listAll("/locks", "locks", prefix);
    }

    /**
     * {@link #listLocks(String, int, String)} for semaphores: each view has the
     * {@link KeyView#limit()}, the permits taken ({@link KeyView#holders()}) and the highest fence.
     *
     * @param prefix the start of the keys to list ({@code ""}: every key)
     * @param limit at most this many on the page (1 to 1000)
     * @param cursor {@code null} for the first page, else the previous page's {@link KeyListing#nextCursor()}
     * @return the page
     */
    public KeyListing listSemaphores(String prefix, int limit, String cursor) {
        return list("/semaphores", "semaphores", prefix, limit, cursor);
    }

    /**
     * Every held semaphore whose key starts with {@code prefix}, in key order.
     *
     * @param prefix the start of the keys to list ({@code ""}: every key)
     * @return the semaphores' views
     */
    public List<KeyView> listSemaphores(String prefix) {
        return listAll("/semaphores", "semaphores", prefix);
    }

    private List<KeyView> listAll(String space, String field, String prefix) {
        List<KeyView> all = new ArrayList<>();
        String cursor = null;
        do {
            KeyListing page = list(space, field, prefix, 1000, cursor);
            all.addAll(page.keys());
            cursor = page.nextCursor().orElse(null);
        } while (cursor != null);
        return all;
    }

    private KeyListing list(String space, String field, String prefix, int limit, String cursor) {
        String p = Keys.checkPrefix(prefix);
        if (limit < 1 || limit > 1000) {
            throw new IllegalArgumentException("a listing's limit is 1 to 1000, not " + limit);
        }
        String what = "list " + field + " under '" + p + "'";
        String path = space + "?prefix=" + p + "&limit=" + limit
                + (cursor == null ? "" : "&cursor=" + URLEncoder.encode(cursor, StandardCharsets.UTF_8));
        HttpResponse<String> response = call("GET", path, what);
        Map<String, Object> answer = Json.parseObject(response.body());
        if (response.statusCode() != 200 || !(answer.get(field) instanceof List)) {
            throw refusal(what, response, answer);
        }
        List<KeyView> views = new ArrayList<>();
        for (Object entry : (List<?>) answer.get(field)) {
            if (entry instanceof Map) {
                @SuppressWarnings("unchecked")
                Map<String, Object> listed = (Map<String, Object>) entry;
                views.add(KeyView.of(string(listed, "key"), true, listed));
            }
        }
        return new KeyListing(views, string(answer, "next_cursor"));
    }

    /**
     * Ends every lease on the lock {@code key} without its token ({@code DELETE
     * /locks/{key}?force=true}); their holders learn it at their next renewal. With auth on it
     * needs the {@code admin} permission; with auth off the broker must run with
     * {@code --allow-force-release}, or it answers {@code 403 forbidden}.
     *
     * @param key the lock's key
     * @return true when leases were ended; false when nobody held it (or an earlier try of this
     *     call, whose answer was lost, had ended them)
     * @throws BrokerUnavailableException when the broker could not be reached or kept answering 503
     * @throws LockBrokerException for any other refusal ({@code 403 forbidden})
     */
    public boolean forceRelease(String key) {
        return forceRelease("/locks/", key);
    }

    /**
     * {@link #forceRelease(String)} for the semaphore {@code key}: ends every permit.
     *
     * @param key the semaphore's key
     * @return true when permits were ended; false when none was held
     */
    public boolean forceReleaseSemaphore(String key) {
        return forceRelease("/semaphores/", key);
    }

    private boolean forceRelease(String space, String key) {
        Keys.check(key);
        String what = "force-release '" + key + "'";
        HttpResponse<String> response = call("DELETE", space + key + "?force=true", what);
        int status = response.statusCode();
        if (status == 204 || status == 200) {
            return true;
        }
        Map<String, Object> answer = Json.parseObject(response.body());
        if (status == 404 && "not_held".equals(string(answer, "error"))) {
            return false;
        }
        throw refusal(what, response, answer);
    }

    /**
     * One request that may be repeated as it is, without a body: {@link #retryable(int)} answers
     * and failed connections are tried again, for up to the request timeout. Any other answer is
     * returned.
     */
    private HttpResponse<String> call(String method, String path, String what) {
        if (closed) {
            throw new IllegalStateException("this LockBroker is closed");
        }
        long deadline = System.nanoTime() + requestTimeout.toNanos();
        Backoff backoff = new Backoff();
        boolean firstAttempt = true;
        while (true) {
            BrokerUnavailableException trouble;
            Long retryAfter = null;
            try {
                HttpResponse<String> response = send(method, path, null, null, requestTimeout);
                if (!retryable(response.statusCode())) {
                    return response;
                }
                trouble = unavailable(what, response, Json.parseObject(response.body()));
                retryAfter = retryAfterMs(response);
            } catch (IOException e) {
                trouble = unreachable(what, e);
            } catch (InterruptedException e) {
                Thread.currentThread().interrupt();
                throw new LockBrokerException("interrupted while trying to " + what, e);
            }
            // A kept-alive connection the broker had closed: try a fresh one at once.
            boolean staleConnection = firstAttempt && trouble.status() == 0
                    && !(trouble.getCause() instanceof java.net.http.HttpTimeoutException);
            firstAttempt = false;
            if (staleConnection) {
                continue;
            }
            if (System.nanoTime() - deadline >= 0) {
                throw trouble;
            }
            if (!backoff.sleep(retryAfter, deadline)) {
                throw new LockBrokerException("interrupted while trying to " + what, new InterruptedException());
            }
        }
    }

    // ---------------------------------------------------------------------------------------
    // Watching

    /**
     * One watch of the lock {@code key}: answers at once when its holders differ from
     * {@code seenFence} (0 for "free"), otherwise when they change within {@code wait}, or with
     * the unchanged view ({@link KeyView#changed()} false) when the wait runs out. A {@code 503}
     * or a failed connection is retried (after {@code Retry-After}, or a backoff) while the wait
     * lasts; a watch changes nothing, so a retry is harmless.
     *
     * @param key the lock's key
     * @param seenFence the fence last seen, 0 for free
     * @param wait how long to wait for a change
     * @return the key's view
     * @throws BrokerUnavailableException when the broker could not be reached or kept answering 503
     * @throws LockBrokerException for any other refusal (auth), or a 5xx other than 502, 503, 504
     */
    public KeyView watch(String key, long seenFence, Duration wait) {
        return watch("/locks/", key, seenFence, wait);
    }

    /**
     * {@link #watch(String, long, Duration)} for the semaphore {@code key} (its fence: the highest permit's).
     *
     * @param key the semaphore's key
     * @param seenFence the highest fence last seen, 0 for free
     * @param wait how long to wait for a change
     * @return the semaphore's view
     */
    public KeyView watchSemaphore(String key, long seenFence, Duration wait) {
        return watch("/semaphores/", key, seenFence, wait);
    }

    /**
     * Follows the lock {@code key}: calls {@code onView} on a thread of its own with the key's
     * view now, then with every change, in order, watching again with each answer's fence (two
     * changes between two watches show as one), until the returned watcher is closed. An
     * unreachable broker is retried for as long as it takes.
     *
     * @param key the lock's key
     * @param onView called with each view, in order, on the watcher's thread
     * @return the watcher: close it to stop
     * @throws BrokerUnavailableException when the first watch found the broker unreachable
     * @throws LockBrokerException when the first watch was refused (auth)
     */
    public KeyWatcher follow(String key, java.util.function.Consumer<KeyView> onView) {
        return follow("/locks/", key, onView);
    }

    /**
     * {@link #follow(String, java.util.function.Consumer)} for the semaphore {@code key}.
     *
     * @param key the semaphore's key
     * @param onView called with each view, in order, on the watcher's thread
     * @return the watcher: close it to stop
     */
    public KeyWatcher followSemaphore(String key, java.util.function.Consumer<KeyView> onView) {
        return follow("/semaphores/", key, onView);
    }

    private KeyWatcher follow(String space, String key, java.util.function.Consumer<KeyView> onView) {
        if (onView == null) {
            throw new IllegalArgumentException("onView is null");
        }
        // The first watch, on the caller's thread, so that a refusal (auth) fails here.
        KeyView first = watch(space, key, 0, Duration.ZERO);
        return new KeyWatcher(this, space, key, first, onView);
    }

    KeyView watch(String space, String key, long seenFence, Duration wait) {
        if (closed) {
            throw new IllegalStateException("this LockBroker is closed");
        }
        Keys.check(key);
        if (seenFence < 0) {
            throw new IllegalArgumentException("seenFence must be 0 (free) or a fence, not " + seenFence);
        }
        long waitMs = Math.min(millis(wait, "wait", 0), TimeUnit.DAYS.toMillis(365));
        long deadline = System.nanoTime() + TimeUnit.MILLISECONDS.toNanos(waitMs);
        String base = space + key; // checked by Keys: nothing in it needs escaping
        Backoff backoff = new Backoff();
        boolean firstAttempt = true;
        while (true) {
            long askWait = Math.min(Math.max(0, TimeUnit.NANOSECONDS.toMillis(deadline - System.nanoTime())),
                    maxWaitPerRequest.toMillis());
            BrokerUnavailableException trouble;
            Long retryAfter = null;
            try {
                HttpResponse<String> response = send("GET", base + "?watch=" + seenFence + "&wait_ms=" + askWait,
                        null, null, Duration.ofMillis(askWait).plus(requestTimeout));
                int status = response.statusCode();
                Map<String, Object> answer = Json.parseObject(response.body());
                String code = string(answer, "error");
                if (status == 200 || status == 404 && "not_held".equals(code)) {
                    KeyView view = KeyView.of(key, status == 200, answer);
                    if (!view.changed() && askWait > 0 && System.nanoTime() - deadline < 0) {
                        continue; // the wait was split over several requests
                    }
                    return view;
                } else if (retryable(status)) {
                    trouble = unavailable("watch '" + key + "'", response, answer);
                    retryAfter = retryAfterMs(response);
                } else {
                    throw refusal("watch '" + key + "'", response, answer);
                }
            } catch (IOException e) {
                trouble = unreachable("watch '" + key + "'", e);
            } catch (InterruptedException e) {
                Thread.currentThread().interrupt();
                throw new LockBrokerException("interrupted while watching '" + key + "'", e);
            }
            // A kept-alive connection the broker had closed: try a fresh one at once.
            boolean staleConnection = firstAttempt && trouble.status() == 0
                    && !(trouble.getCause() instanceof java.net.http.HttpTimeoutException);
            firstAttempt = false;
            if (staleConnection) {
                continue;
            }
            if (System.nanoTime() - deadline >= 0) {
                throw trouble;
            }
            if (!backoff.sleep(retryAfter, deadline)) {
                throw new LockBrokerException("interrupted while watching '" + key + "'", new InterruptedException());
            }
        }
    }

    // ---------------------------------------------------------------------------------------
    // HTTP

    HttpRequest request(String method, String path, String body, String leaseToken, Duration timeout) {
        HttpRequest.Builder b = HttpRequest.newBuilder(URI.create(url + path))
                .timeout(timeout)
                .header("Accept", "application/json");
        if (body != null) {
            b.header("Content-Type", "application/json");
        }
        if (authToken != null) {
            b.header("Authorization", "Bearer " + authToken);
        }
        if (leaseToken != null) {
            b.header("Lock-Token", leaseToken);
        }
        HttpRequest.BodyPublisher publisher = body == null
                ? HttpRequest.BodyPublishers.noBody()
                : HttpRequest.BodyPublishers.ofString(body, StandardCharsets.UTF_8);
        return b.method(method, publisher).build();
    }

    HttpResponse<String> send(String method, String path, String body, String leaseToken, Duration timeout)
            throws IOException, InterruptedException {
        return http.send(request(method, path, body, leaseToken, timeout),
                HttpResponse.BodyHandlers.ofString(StandardCharsets.UTF_8));
    }

    CompletableFuture<HttpResponse<String>> sendAsync(String method, String path, String body,
            String leaseToken, Duration timeout) {
        return http.sendAsync(request(method, path, body, leaseToken, timeout),
                HttpResponse.BodyHandlers.ofString(StandardCharsets.UTF_8));
    }

    /** {@code Retry-After} in milliseconds, when the broker sent it as whole seconds. */
    static Long retryAfterMs(HttpResponse<?> response) {
        Optional<String> header = response.headers().firstValue("Retry-After");
        if (header.isEmpty()) {
            return null;
        }
        try {
            return Math.max(0, Long.parseLong(header.get().strip())) * 1000;
        } catch (NumberFormatException e) {
            return null;
        }
    }

    /**
     * Whether an answer means "try again": {@code 503} (store unavailable, shutting down, a
     * store-wide hold), {@code 429} (too many waiters), or a proxy's {@code 502}/{@code 504} (no
     * broker behind it just now). Any other 5xx is not the broker's (it answers none other) and
     * is not retried.
     */
    static boolean retryable(int status) {
        return status == 503 || status == 429 || status == 502 || status == 504;
    }

    /** A refusal, or an answer no retry would change: names what was asked, the URL and the answer. */
    LockBrokerException refusal(String what, HttpResponse<String> response, Map<String, Object> answer) {
        return new LockBrokerException("cannot " + what + " at " + url + ": " + answered(response, answer),
                response.statusCode(), string(answer, "error"), null);
    }

    /** A {@link #retryable(int)} answer, for when the tries have run out. */
    BrokerUnavailableException unavailable(String what, HttpResponse<String> response, Map<String, Object> answer) {
        return new BrokerUnavailableException("cannot " + what + " at " + url + ": " + answered(response, answer),
                response.statusCode(), string(answer, "error"), null);
    }

    /** No answer: the connection failed or the request timed out. */
    BrokerUnavailableException unreachable(String what, IOException e) {
        return new BrokerUnavailableException("cannot " + what + ": cannot reach the broker at " + url + ": " + e,
                0, null, e);
    }

    /** "the broker answered 503 store_unavailable (its message)", or a glimpse of a body that is not the broker's. */
    static String answered(HttpResponse<String> response, Map<String, Object> answer) {
        String code = string(answer, "error");
        String message = string(answer, "message");
        String text = "the broker answered " + response.statusCode() + (code == null ? "" : " " + code)
                + (message == null ? "" : " (" + message + ")");
        if (code == null && message == null) {
            String body = response.body() == null ? "" : response.body().strip().replaceAll("\\s+", " ");
            if (!body.isEmpty()) {
                text += " (not a lockbroker answer: " + (body.length() > 120 ? body.substring(0, 120) + "..." : body)
                        + ")";
            }
        }
        return text;
    }

    static String string(Map<String, Object> map, String field) {
        Object value = map.get(field);
        return value instanceof String ? (String) value : null;
    }

    static Long number(Map<String, Object> map, String field) {
        Object value = map.get(field);
        return value instanceof Number ? ((Number) value).longValue() : null;
    }

    static void warn(String message) {
        LOG.log(System.Logger.Level.WARNING, message);
    }

    private static long millis(Duration d, String name, long min) {
        if (d == null) {
            throw new IllegalArgumentException(name + " is required");
        }
        if (d.isNegative() || d.compareTo(Duration.ofDays(3650)) > 0) {
            throw new IllegalArgumentException(name + " must be between " + min + " ms and ten years, not " + d);
        }
        long ms = d.toMillis();
        if (ms < min) {
            throw new IllegalArgumentException(name + " must be at least " + min + " ms, not " + d);
        }
        return ms;
    }

    private static Duration positive(Duration d, String name) {
        if (d == null || d.isZero() || d.isNegative()) {
            throw new IllegalArgumentException(name + " must be positive, not " + d);
        }
        return d;
    }

    /** 22 URL-safe characters: 128 random bits, as the broker's request_id allows (1 to 64). */
    private static String newRequestId() {
        byte[] bytes = new byte[16];
        RANDOM.nextBytes(bytes);
        return Base64.getUrlEncoder().withoutPadding().encodeToString(bytes);
    }

    private static ThreadFactory daemon(String name) {
        AtomicInteger n = new AtomicInteger();
        return task -> {
            Thread t = new Thread(task, name + "-" + n.incrementAndGet());
            t.setDaemon(true);
            return t;
        };
    }

    /**
     * The base URL this client talks to.
     *
     * @return the URL, without a trailing slash
     */
    public String url() {
        return url;
    }

    boolean isClosed() {
        return closed;
    }

    /**
     * Stops every background renewal for good and releases the leases still open (each
     * release bounded by the release timeout). Idempotent.
     */
    @Override
    public void close() {
        if (closed) {
            return;
        }
        closed = true;
        List<CompletableFuture<Void>> releases = new ArrayList<>();
        for (Lease lease : open) {
            releases.add(CompletableFuture.runAsync(lease::release, background));
        }
        try {
            CompletableFuture.allOf(releases.toArray(new CompletableFuture<?>[0]))
                    .get(releaseTimeout.plus(requestTimeout).toMillis(), TimeUnit.MILLISECONDS);
        } catch (InterruptedException e) {
            Thread.currentThread().interrupt();
        } catch (Exception e) {
            warn("not every lease was released on close: " + e);
        }
        timer.shutdownNow();
        callbacks.shutdown();
        background.shutdownNow();
        httpThreads.shutdown();
    }

    @Override
    public String toString() {
        return "LockBroker[" + url + (closed ? ", closed" : "") + "]";
    }
}
