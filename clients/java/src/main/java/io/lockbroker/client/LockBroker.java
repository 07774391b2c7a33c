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
import java.util.concurrent.CompletableFuture;
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

    /** A client of the broker at {@code url} ({@code http://host:port}), with every default. */
    public static LockBroker create(String url) {
        return builder().url(url).build();
    }

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

        /** The broker's base URL, {@code http://host:port} or {@code https://...}. */
        public Builder url(String url) {
            this.url = url;
            return this;
        }

        /** The bearer token for a broker with auth on (sent as {@code Authorization: Bearer}); optional. */
        public Builder authToken(String authToken) {
            this.authToken = authToken;
            return this;
        }

        /**
         * When a lease is renewed, as a fraction of its ttl (default 1/3: three chances to renew
         * before it ends). Between 0.05 and 0.8.
         */
        public Builder renewFraction(double fraction) {
            if (!(fraction >= 0.05 && fraction <= 0.8)) {
                throw new IllegalArgumentException("renewFraction must be between 0.05 and 0.8, not " + fraction);
            }
            this.renewFraction = fraction;
            return this;
        }

        /** How long connecting to the broker may take (default 2 s). */
        public Builder connectTimeout(Duration timeout) {
            this.connectTimeout = positive(timeout, "connectTimeout");
            return this;
        }

        /**
         * How long an answer may take beyond the wait the request asked for (default 5 s: the
         * broker's store bound is 2 s by default). A request past it counts as a failed
         * connection and is retried.
         */
        public Builder requestTimeout(Duration timeout) {
            this.requestTimeout = positive(timeout, "requestTimeout");
            return this;
        }

        /** How long {@link Lease#release()} keeps retrying a broker that does not answer (default 2 s). */
        public Builder releaseTimeout(Duration timeout) {
            this.releaseTimeout = positive(timeout, "releaseTimeout");
            return this;
        }

        /**
         * The longest {@code wait_ms} one request asks for (default 60 s, the broker's default
         * {@code max_wait_ms}); a longer wait is made of several requests.
         */
        public Builder maxWaitPerRequest(Duration max) {
            this.maxWaitPerRequest = positive(max, "maxWaitPerRequest");
            return this;
        }

        /** The {@code owner} label every acquire sends unless it names its own (shown by {@code GET}, for people). */
        public Builder owner(String owner) {
            this.owner = owner;
            return this;
        }

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
     * @throws LockedException when someone else still held it after {@code wait}
     * @throws BrokerUnavailableException when the broker could not be reached or kept answering
     *     503 until {@code wait} ran out
     * @throws LockBrokerException for any other refusal (bad key, auth)
     */
    public Lease acquire(String key, Duration ttl, Duration wait) {
        return lock(key).ttl(ttl).maxWait(wait).acquire();
    }

    /**
     * Takes the exclusive lock on {@code key} if it is free now ({@code wait_ms=0}); empty when
     * someone else holds it.
     *
     * @throws BrokerUnavailableException when the broker could not be reached or answered 503
     */
    public Optional<Lease> tryAcquire(String key, Duration ttl) {
        return lock(key).ttl(ttl).tryAcquire();
    }

    /** A shared (read) lease on {@code key}: any number at once, never together with an exclusive one. */
    public Lease acquireShared(String key, Duration ttl, Duration wait) {
        return lock(key).shared().ttl(ttl).maxWait(wait).acquire();
    }

    /** A shared lease on {@code key} if one can be had now. */
    public Optional<Lease> tryAcquireShared(String key, Duration ttl) {
        return lock(key).shared().ttl(ttl).tryAcquire();
    }

    /** One of {@code limit} permits of the semaphore {@code key}, waiting up to {@code wait}. */
    public Lease acquirePermit(String key, int limit, Duration ttl, Duration wait) {
        return semaphore(key, limit).ttl(ttl).maxWait(wait).acquire();
    }

    /** One of {@code limit} permits of the semaphore {@code key} if one is free now. */
    public Optional<Lease> tryAcquirePermit(String key, int limit, Duration ttl) {
        return semaphore(key, limit).ttl(ttl).tryAcquire();
    }

    /** A request for the lock on {@code key}, to set more than the shortcuts do (owner, shared, no auto-renew). */
    public LockRequest lock(String key) {
        return new LockRequest(this, key, Lease.Kind.EXCLUSIVE, 0);
    }

    /** A request for one of {@code limit} permits of the semaphore {@code key} (1..=10000). */
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
                trouble = new BrokerUnavailableException(
                        "cannot reach the broker at " + url + ": " + e, 0, null, e);
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
                        trouble = new BrokerUnavailableException("the broker granted '" + r.key
                                + "' but did not confirm it with a renewal", 0, null, null);
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
                    throw new LockedException(r.key, retryMs == null ? null : Duration.ofMillis(retryMs));
                } else if (status == 503 || status == 429 || status >= 500) {
                    trouble = new BrokerUnavailableException("the broker answered " + status
                            + (code == null ? "" : " " + code) + describe(answer), status, code, null);
                    retryAfter = retryAfterMs(response);
                } else {
                    if (retried) {
                        cleanUpAfter(path, body, unsureSince, ttlMs, System.nanoTime());
                    }
                    throw refusal("acquire '" + r.key + "'", status, answer);
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
                    if (status == 409 && conclusive || status != 409 && status != 503 && status != 429 && status < 500) {
                        return; // not ours: someone else holds it, or nothing to find
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
    // Watching

    /**
     * One watch of the lock {@code key}: answers at once when its holders differ from
     * {@code seenFence} (0 for "free"), otherwise when they change within {@code wait}, or with
     * the unchanged view ({@link KeyView#changed()} false) when the wait runs out. A {@code 503}
     * or a failed connection is retried (after {@code Retry-After}, or a backoff) while the wait
     * lasts; a watch changes nothing, so a retry is harmless.
     *
     * @throws BrokerUnavailableException when the broker could not be reached or kept answering 503
     * @throws LockBrokerException for any other refusal (bad key, auth)
     */
    public KeyView watch(String key, long seenFence, Duration wait) {
        return watch("/locks/", key, seenFence, wait);
    }

    /** {@link #watch(String, long, Duration)} for the semaphore {@code key} (its fence: the highest permit's). */
    public KeyView watchSemaphore(String key, long seenFence, Duration wait) {
        return watch("/semaphores/", key, seenFence, wait);
    }

    /**
     * Follows the lock {@code key}: calls {@code onView} on a thread of its own with the key's
     * view now, then with every change, in order, watching again with each answer's fence (two
     * changes between two watches show as one), until the returned watcher is closed. An
     * unreachable broker is retried for as long as it takes.
     *
     * @throws BrokerUnavailableException when the first watch found the broker unreachable
     * @throws LockBrokerException when the first watch was refused (bad key, auth)
     */
    public KeyWatcher follow(String key, java.util.function.Consumer<KeyView> onView) {
        return follow("/locks/", key, onView);
    }

    /** {@link #follow(String, java.util.function.Consumer)} for the semaphore {@code key}. */
    public KeyWatcher followSemaphore(String key, java.util.function.Consumer<KeyView> onView) {
        return follow("/semaphores/", key, onView);
    }

    private KeyWatcher follow(String space, String key, java.util.function.Consumer<KeyView> onView) {
        if (onView == null) {
            throw new IllegalArgumentException("onView is null");
        }
        // The first watch, on the caller's thread, so that a bad key or auth fails here.
        KeyView first = watch(space, key, 0, Duration.ZERO);
        return new KeyWatcher(this, space, key, first, onView);
    }

    KeyView watch(String space, String key, long seenFence, Duration wait) {
        if (closed) {
            throw new IllegalStateException("this LockBroker is closed");
        }
        if (key == null) {
            throw new IllegalArgumentException("key is required");
        }
        if (seenFence < 0) {
            throw new IllegalArgumentException("seenFence must be 0 (free) or a fence, not " + seenFence);
        }
        long waitMs = Math.min(millis(wait, "wait", 0), TimeUnit.DAYS.toMillis(365));
        long deadline = System.nanoTime() + TimeUnit.MILLISECONDS.toNanos(waitMs);
        String base = space + URLEncoder.encode(key, StandardCharsets.UTF_8).replace("+", "%20");
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
                } else if (status == 503 || status == 429 || status >= 500) {
                    trouble = new BrokerUnavailableException("the broker answered " + status
                            + (code == null ? "" : " " + code) + describe(answer), status, code, null);
                    retryAfter = retryAfterMs(response);
                } else {
                    throw refusal("watch '" + key + "'", status, answer);
                }
            } catch (IOException e) {
                trouble = new BrokerUnavailableException("cannot reach the broker at " + url + ": " + e, 0, null, e);
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

    static LockBrokerException refusal(String what, int status, Map<String, Object> answer) {
        String code = string(answer, "error");
        return new LockBrokerException("cannot " + what + ": the broker answered " + status
                + (code == null ? "" : " " + code) + describe(answer), status, code, null);
    }

    private static String describe(Map<String, Object> answer) {
        String message = string(answer, "message");
        return message == null ? "" : " (" + message + ")";
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

    /** The base URL this client talks to. */
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
