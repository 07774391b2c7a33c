package io.lockbroker.client;

import java.io.IOException;
import java.net.http.HttpResponse;
import java.time.Duration;
import java.time.Instant;
import java.util.ArrayList;
import java.util.LinkedHashMap;
import java.util.LinkedHashSet;
import java.util.List;
import java.util.Map;
import java.util.Optional;
import java.util.Set;
import java.util.concurrent.CompletableFuture;
import java.util.concurrent.RejectedExecutionException;
import java.util.concurrent.ScheduledFuture;
import java.util.concurrent.TimeUnit;

/**
 * A session of the broker ({@code POST /sessions}): one keep-alive for every lease taken under
 * it. The leases have no ttl of their own and are not renewed one by one; the session's
 * keep-alive ({@code POST /sessions/{S}/renew}, at a third of its ttl by default, on the
 * client's renewal timer) keeps them all. When the node dies, its keep-alives stop and every
 * lease under the session ends with it, at the broker.
 *
 * <pre>{@code
 * try (Session session = broker.openSession(Duration.ofSeconds(15))) {
 *     session.onLost(() -> worker.cancel());
 *     Lease a = session.acquire("orders:42", Duration.ofSeconds(5));
 *     Optional<Lease> b = session.tryAcquire("orders:43");
 *     ...
 * }   // closes the session: every lease under it is released at once
 * }</pre>
 *
 * <p>The session is <em>lost</em>, once, when a keep-alive answers {@code 404} (it ended at the
 * broker), {@code 401}/{@code 403} (the bearer token was refused), or when its end comes
 * without a confirmed keep-alive (counted from the keep-alive's send, less a margin, as for a
 * lease). Then {@link #isAlive()} turns false, every lease taken under it is lost too (each
 * lease's own {@link Lease#onLost(Runnable)} callbacks run, {@link Lease#isHeld()} false), and
 * the session's {@link #onLost(Runnable)} callbacks run, on a client thread. A session lost for
 * want of an answer is closed in the background, in case the broker still counts it.
 *
 * <p>The session's secret is never shown by {@link #toString()}, never logged and never put in
 * an exception message. Thread-safe; like a lease, it belongs to whoever holds this object.
 */
public final class Session extends SessionKeepAlive implements AutoCloseable {
    private Session(LockBroker broker, Map<String, Object> answer, long sentNanos, long askedTtlMs, long lockDelayMs) {
        super(broker, answer, sentNanos, askedTtlMs, lockDelayMs);
    }

    /**
     * Opens a session ({@code POST /sessions} with a generated {@code request_id}), retrying
     * {@code 503}s and failed connections with the same {@code request_id} for up to the request
     * timeout, and starts its keep-alive. A session made by a try whose answer never came holds
     * nothing and ends by its ttl.
     */
    static Session open(LockBroker broker, Duration ttl, Duration lockDelay) {
        long ttlMs = KeyCalls.millis(ttl, "ttl", 1);
        long delayMs = KeyCalls.millis(lockDelay, "lockDelay", 0);
        broker.checkOpen();
        Map<String, Object> body = new LinkedHashMap<>();
        body.put("ttl_ms", ttlMs);
        body.put("lock_delay_ms", delayMs);
        body.put("owner", broker.owner);
        body.put("request_id", Acquisition.newRequestId());
        String what = "open a session";
        Http http = broker.http;
        Http.Retries retries = new Http.Retries(System.nanoTime() + http.requestTimeout.toNanos());
        // A session made by any try (they share the request_id) ends no earlier than the first send plus the ttl.
        long firstSent = System.nanoTime();
        while (true) {
            BrokerUnavailableException trouble;
            Long retryAfter = null;
            try {
                HttpResponse<String> response = http.send("POST", "/sessions", Json.object(body), null,
                        http.requestTimeout);
                Map<String, Object> answer = Json.parseObject(response.body());
                int status = response.statusCode();
                if (status == 201) {
                    Session session = new Session(broker, answer, firstSent, ttlMs, delayMs);
                    broker.sessions.add(session);
                    session.start();
                    if (broker.isClosed()) {
                        session.close();
                        throw new IllegalStateException("this LockBroker was closed while opening a session");
                    }
                    return session;
                }
                if (!Http.retryable(status)) {
                    throw http.refusal(what, response, answer);
                }
                trouble = http.unavailable(what, response, answer);
                retryAfter = Http.retryAfterMs(response);
            } catch (IOException e) {
                trouble = http.unreachable(what, e);
            } catch (InterruptedException e) {
                Thread.currentThread().interrupt();
                throw new LockBrokerException("interrupted while trying to " + what, e);
            }
            retries.after(trouble, retryAfter, "interrupted while trying to " + what);
        }
    }

    // ---------------------------------------------------------------------------------------
    // Acquiring under the session

    /**
     * Takes the exclusive lock on {@code key} under this session, waiting up to {@code wait}
     * while someone else holds it (the broker does the waiting). The lease has no ttl of its
     * own: it lives as long as the session, and is not renewed by itself.
     *
     * @param key the lock's key (1 to 200 of {@code A-Z a-z 0-9 . _ - :})
     * @param wait how long to wait while someone else holds it
     * @return the lease, held while the session lives
     * @throws LockedException when someone else still held it after {@code wait}
     * @throws BrokerUnavailableException when the broker could not be reached or kept answering
     *     503 until {@code wait} ran out
     * @throws LockBrokerException when the session is lost or ended ({@code code()}
     *     {@code "no_session"}), or for any other refusal
     * @throws IllegalStateException when the session is closed
     */
    public Lease acquire(String key, Duration wait) {
        return lock(key).maxWait(wait).acquire();
    }

    /**
     * Takes the exclusive lock on {@code key} under this session if it is free now
     * ({@code wait_ms=0}); empty when someone else holds it.
     *
     * @param key the lock's key
     * @return the lease; empty when someone else holds it
     * @throws BrokerUnavailableException when the broker could not be reached or answered 503
     * @throws LockBrokerException when the session is lost or ended ({@code "no_session"})
     * @throws IllegalStateException when the session is closed
     */
    public Optional<Lease> tryAcquire(String key) {
        return lock(key).tryAcquire();
    }

    /**
     * Takes the exclusive locks on every one of {@code keys} at once under this session, or none
     * of them ({@code POST /locks} with the session), waiting up to {@code wait} while someone
     * else holds any. As {@link LockBroker#acquireAll(List, Duration, Duration)}, but the one
     * lease returned has no ttl of its own: it lives as long as the session, and its keys are not
     * renewed one by one.
     *
     * @param keys 1 to 64 distinct keys
     * @param wait how long to wait while someone else holds any of them
     * @return the lease of every key, held while the session lives
     * @throws LockedException when not every key could be had within {@code wait}
     *     ({@link LockedException#heldKeys()}: the busy ones); none is held then
     * @throws BrokerUnavailableException when the broker could not be reached or kept answering
     *     503 until {@code wait} ran out
     * @throws LockBrokerException when the session is lost or ended ({@code "no_session"}), or
     *     for any other refusal
     * @throws IllegalStateException when the session is closed
     */
    public Lease acquireAll(List<String> keys, Duration wait) {
        return new LockRequest(broker, keys, this).maxWait(wait).acquire();
    }

    /**
     * A request for the lock on {@code key} under this session, to set more than
     * {@link #acquire(String, Duration)} does ({@code .shared()}, {@code .owner(label)},
     * {@code .maxWait(d)}); it takes no ttl.
     *
     * @param key the lock's key
     * @return the request, to set and then acquire
     */
    public LockRequest lock(String key) {
        return new LockRequest(broker, key, Lease.Kind.EXCLUSIVE, 0, this);
    }

    /**
     * A request for one of {@code limit} permits of the semaphore {@code key} under this session.
     *
     * @param key the semaphore's key
     * @param limit how many permits it has (every holder must give the same)
     * @return the request, to set and then acquire
     */
    public LockRequest semaphore(String key, int limit) {
        if (limit < 1) {
            throw new IllegalArgumentException("a semaphore's limit must be at least 1, not " + limit);
        }
        return new LockRequest(broker, key, Lease.Kind.PERMIT, limit, this);
    }

    // ---------------------------------------------------------------------------------------
    // State

    /**
     * True while the session lives: not closed, not lost, and its end (as this client counts
     * it, conservatively) not passed.
     *
     * @return true while alive
     */
    public boolean isAlive() {
        String reason;
        synchronized (this) {
            if (state != State.ALIVE) {
                return false;
            }
            if (System.nanoTime() - lostAt() < 0) {
                return true;
            }
            reason = "its end came without a confirmed keep-alive" + (trouble == null ? "" : " (last: " + trouble + ")");
        }
        lost(reason, false);
        return false;
    }

    /**
     * Runs {@code callback} once, on a client thread, when the session is lost (after the lost
     * callbacks of its leases have been handed to that thread); at once, on the calling thread,
     * if it is lost already. Never after a {@link #close()} (that is not a loss).
     *
     * @param callback what to run when the session is lost (stop writing)
     */
    public void onLost(Runnable callback) {
        if (callback == null) {
            throw new IllegalArgumentException("callback is null");
        }
        boolean now;
        synchronized (this) {
            now = state == State.LOST;
            if (state == State.ALIVE) {
                onLost.add(callback);
            }
        }
        if (now) {
            runCallback(callback);
        }
    }

    /**
     * Why the session was lost, once it is: {@code "a keep-alive was answered 404 not_held ..."},
     * {@code "an acquire was answered 404 no_session ..."}, or {@code "its end came without a
     * confirmed keep-alive (last: ...)"}.
     *
     * @return the reason; empty while the session lives or after a plain close
     */
    public synchronized Optional<String> lostReason() {
        return Optional.ofNullable(lostReason);
    }

    /**
     * The session's ttl: each keep-alive extends it by that much.
     *
     * @return the ttl
     */
    public Duration ttl() {
        return Duration.ofMillis(ttlMs);
    }

    /**
     * How long the keys of this session stay locked after it ends by expiry (not after a close).
     *
     * @return the lock delay; zero for none
     */
    public Duration lockDelay() {
        return Duration.ofMillis(lockDelayMs);
    }

    /**
     * When the session ends by the broker's latest answer, on the store's clock.
     *
     * @return the end, as of the last confirmed open or keep-alive
     */
    public synchronized Instant expiresAt() {
        return Instant.ofEpochMilli(expiresAtMs);
    }

    /**
     * Closes the session: stops its keep-alive, marks every lease under it released, and
     * {@code DELETE}s it, which releases them all at the broker at once (no lock delay).
     * Idempotent, and never throws: a session already ended is fine, and if the broker cannot
     * be reached for the release timeout it logs a warning, and the leases end with the
     * session's ttl. Lost callbacks do not run.
     */
    @Override
    public void close() {
        List<Lease> under;
        boolean send;
        synchronized (this) {
            if (deleteSent || state == State.CLOSED) {
                return;
            }
            send = !(state == State.LOST && lostForSure);
            state = state == State.LOST ? State.LOST : State.CLOSED;
            deleteSent = true;
            cancelTimers();
            under = new ArrayList<>(leases);
            leases.clear();
        }
        broker.sessions.remove(this);
        for (Lease lease : under) {
            lease.releasedWithSession();
        }
        if (send) {
            delete();
        }
    }

    @Override
    public String toString() {
        synchronized (this) {
            String s = state == State.ALIVE ? "alive" : state == State.LOST ? "lost" : "closed";
            return "Session[ttl=" + ttl() + ", lockDelay=" + lockDelay() + ", leases=" + leases.size() + ", " + s + "]";
        }
    }

    // ---------------------------------------------------------------------------------------
    // For the acquire loop and the leases

    /** The secret, for an acquire's body: never to be shown. */
    String secret() {
        return id;
    }

    long ttlMillis() {
        return ttlMs;
    }

    /** Throws unless the session can take a lease: closed, or lost (as a {@code no_session} refusal). */
    void checkAlive(String what) {
        if (!isAlive()) {
            throw notAlive(what);
        }
    }

    /** The error for a session that is not alive: closed, or lost (as a {@code no_session} refusal). */
    synchronized RuntimeException notAlive(String what) {
        if (state != State.LOST) {
            return new IllegalStateException("cannot " + what + ": this session is closed");
        }
        return new LockBrokerException("cannot " + what + " at " + broker.url + ": the session was lost: " + lostReason,
                lostForSure ? 404 : 0, "no_session", null);
    }

    /** Takes a lease granted under this session (each key's part); false when the session ended meanwhile. */
    boolean adopt(Lease lease) {
        if (!isAlive()) {
            return false;
        }
        synchronized (this) {
            if (state != State.ALIVE) {
                return false;
            }
            leases.addAll(lease.parts());
            return true;
        }
    }

    /** A lease under this session was released or lost by itself (a force release). */
    synchronized void forget(Lease lease) {
        leases.remove(lease);
    }

    /** An acquire under the session was answered {@code 404 no_session}: it has ended at the broker. */
    void ended(String answer) {
        lost("an acquire was answered " + answer, true);
    }
}
