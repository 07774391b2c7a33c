package io.lockbroker.client;

import java.io.IOException;
import java.net.http.HttpResponse;
import java.time.Duration;
import java.time.Instant;
import java.util.ArrayList;
import java.util.List;
import java.util.Map;
import java.util.Optional;
import java.util.concurrent.CompletableFuture;
import java.util.concurrent.TimeUnit;
import java.util.concurrent.TimeoutException;
import java.util.function.Consumer;

/**
 * What one successful acquire returns: a lease on a lock, a shared lock or a semaphore permit,
 * renewed in the background at a third of its ttl (by default) until {@link #release()}.
 *
 * <p>The lease is <em>lost</em>, once, when a renewal answers {@code 404}/{@code 409} (it was
 * force-released, or ended and was taken over) or {@code 401}/{@code 403} (the bearer token was
 * revoked or lost its permission), or when its end comes without a confirmed renewal (the broker
 * unreachable or answering 503; {@link #onTrouble(Consumer)} hears of the failed renewals
 * before). The client counts that end from the moment
 * it <em>sent</em> the acquire or renewal, less a margin (a tenth of the ttl, at most 1 s), so
 * the signal comes before the broker's end, not after it. Then {@link #isHeld()} turns false and
 * the {@link #onLost(Runnable)} callbacks run on a client thread. An application told its lease
 * is lost must stop writing; the {@link #fence()} it passed along with each write lets the
 * resource refuse the writes that were already on their way.
 *
 * <p>A lease taken under a {@link Session} is not renewed by itself: the session's keep-alive
 * keeps it, and it is lost when the session is ({@link Session#onLost(Runnable)}), or when a
 * {@link #renew()} finds it force-released. Releasing it releases that lease only; closing the
 * session releases it too.
 *
 * <p>A lease of several keys at once ({@link LockBroker#acquireAll(List, Duration, Duration)})
 * holds every one of them with one token: {@link #key()} and {@link #fence()} are the first
 * key's, {@link #fence(String)} each key's. Each key is renewed (unless under a session) and
 * watched for loss as a lease of one key is; if any key is lost, the whole lease is lost (its
 * callbacks run once) and the other keys are released. {@link #release()} releases them all.
 *
 * <p>Ownership is this object (it holds the token), not a thread: any thread may release it.
 * The token is never shown by {@link #toString()} nor logged.
 */
public final class Lease extends LeaseRenewal implements AutoCloseable {
    /** What a lease is on. */
    public enum Kind {
        /** The lock, alone. */
        EXCLUSIVE,
        /** The lock, with other shared holders. */
        SHARED,
        /** One permit of a semaphore. */
        PERMIT
    }

    Lease(LockBroker broker, LockRequest r, Map<String, Object> answer, long sentNanos, long askedTtlMs) {
        super(broker, r, answer, sentNanos, askedTtlMs);
    }

    /**
     * The key (lock or semaphore name).
     *
     * @return the key
     */
    public String key() {
        return key;
    }

    /**
     * The fence: greater than every fence granted before on this key. Pass it with every write.
     *
     * @return the fence
     */
    public long fence() {
        return fence;
    }

    /**
     * Every key the lease holds: {@link #key()} alone, or the keys of
     * {@link LockBroker#acquireAll(List, Duration, Duration) acquireAll} in their order.
     *
     * @return the keys
     */
    public List<String> keys() {
        List<String> keys = new ArrayList<>();
        for (Lease part : parts()) {
            keys.add(part.key);
        }
        return List.copyOf(keys);
    }

    /**
     * The fence of one of the lease's keys (of a lease of several keys, each key has its own).
     *
     * @param key one of {@link #keys()}
     * @return that key's fence
     * @throws IllegalArgumentException when the lease does not hold {@code key}
     */
    public long fence(String key) {
        for (Lease part : parts()) {
            if (part.key.equals(key)) {
                return part.fence;
            }
        }
        throw new IllegalArgumentException("this lease does not hold '" + key + "'; it holds " + keys());
    }

    /** This lease's parts: one per key (itself alone for a lease of one key). */
    List<Lease> parts() {
        return group == null ? List.of(this) : group.parts;
    }

    /**
     * Exclusive, shared, or a semaphore permit.
     *
     * @return what the lease is on
     */
    public Kind kind() {
        return kind;
    }

    /**
     * The semaphore's limit for a permit; 0 for a lock.
     *
     * @return the limit, or 0
     */
    public int limit() {
        return limit;
    }

    /**
     * The ttl each renewal asks for (under a session: the session's ttl).
     *
     * @return the ttl
     */
    public Duration ttl() {
        return Duration.ofMillis(ttlMs);
    }

    /**
     * When the lease ends by the broker's latest answer, on the store's clock (under a session:
     * the session's end).
     *
     * @return the end, as of the last confirmed acquire or renewal
     */
    public Instant expiresAt() {
        if (session != null) {
            return session.expiresAt();
        }
        synchronized (this) {
            return Instant.ofEpochMilli(expiresAtMs);
        }
    }

    /**
     * True while the lease is held: not released, not lost, and its end (as this client counts
     * it, conservatively) not passed; under a session, while the session {@link Session#isAlive()
     * is alive} too. Of a lease of several keys: true while every key is held.
     *
     * @return true while held
     */
    @Override
    public boolean isHeld() {
        boolean all = true;
        for (Lease part : parts()) {
            all &= part.heldAlone(); // each part, to notice its end
        }
        return all;
    }

    private boolean heldAlone() {
        if (session != null) {
            // A session found ended loses its leases, this one too.
            boolean alive = session.isAlive();
            synchronized (this) {
                return alive && state == State.HELD;
            }
        }
        String reason;
        synchronized (this) {
            if (state != State.HELD) {
                return false;
            }
            if (System.nanoTime() - lostAt() < 0) {
                return true;
            }
            reason = "its end came without a confirmed renewal"
                    + (trouble == null ? "" : " (last: " + trouble.getMessage() + ")");
        }
        lost(reason, false);
        return false;
    }

    /** Throws {@link LeaseLostException} unless {@link #isHeld()}: a check before each write. */
    public void ensureHeld() {
        if (!isHeld()) {
            throw new LeaseLostException(describeLoss());
        }
    }

    /**
     * Why the lease was lost, once it is: {@code "a renewal was answered 404 not_held ..."} (or
     * {@code 409 not_owner}, {@code 401 unauthorized}, {@code 403 forbidden}), or
     * {@code "its end came without a confirmed renewal (last: ...)"}.
     *
     * @return the reason; empty while the lease is held or after a plain release
     */
    public synchronized Optional<String> lostReason() {
        return Optional.ofNullable(lostReason);
    }

    /**
     * Runs {@code callback} once, on a client thread, when the lease is lost; at once, on the
     * calling thread, if it is lost already. Never after a release (that is not a loss).
     *
     * @param callback what to run when the lease is lost (stop writing)
     */
    public void onLost(Runnable callback) {
        if (callback == null) {
            throw new IllegalArgumentException("callback is null");
        }
        boolean now;
        synchronized (this) {
            now = state == State.LOST;
            if (state == State.HELD) {
                onLost.add(callback);
            }
        }
        if (now) {
            runCallback(callback);
        }
    }

    /**
     * Runs {@code hook} on a client thread when a background renewal fails without an answer
     * that ends the lease (no answer, a 503 or another 5xx, a {@code 400}; not a
     * {@code 404}/{@code 409}/{@code 401}/{@code 403}, which lose it):
     * once per run of failed renewals, at the first, while they are retried until the lease
     * would end. A renewal that gets through ends the run; the next failure is reported again.
     * Registered during such a run, it runs at once on the calling thread with the last failure.
     * The exception names the key, the broker's URL and what it answered. Meant for a log line
     * or a metric: it must be quick, as it runs on the thread of the lost-lease callbacks.
     *
     * @param hook called with the failed renewal's error
     */
    public void onTrouble(Consumer<LockBrokerException> hook) {
        if (hook == null) {
            throw new IllegalArgumentException("hook is null");
        }
        for (Lease part : parts()) {
            part.troubleAlone(hook);
        }
    }

    private void troubleAlone(Consumer<LockBrokerException> hook) {
        LockBrokerException now;
        synchronized (this) {
            if (state == State.HELD) {
                onTrouble.add(hook);
            }
            now = state == State.HELD ? trouble : null;
        }
        if (now != null) {
            runTroubleHook(hook, now);
        }
    }

    /**
     * Renews the lease now, for its ttl (the background renewal does this by itself); every key
     * of a lease of several keys, one by one.
     *
     * @throws LeaseLostException it was already lost or released, or the broker says it ended
     *     ({@code 404}/{@code 409}), or refused the token ({@code 401}/{@code 403})
     * @throws BrokerUnavailableException the broker could not be reached or answered 503 (or 429,
     *     or a proxy's 502/504)
     * @throws LockBrokerException any other answer (the broker's {@code 400}, a 5xx that is not)
     */
    public void renew() {
        for (Lease part : parts()) {
            part.renewAlone();
        }
    }

    private void renewAlone() {
        synchronized (this) {
            if (state != State.HELD) {
                throw new LeaseLostException(describeLoss());
            }
        }
        long sent = System.nanoTime();
        HttpResponse<String> response;
        try {
            response = broker.http.send("POST", path + "/renew", renewBody(), token, broker.http.requestTimeout);
        } catch (IOException e) {
            throw broker.http.unreachable("renew '" + key + "'", e);
        } catch (InterruptedException e) {
            Thread.currentThread().interrupt();
            throw new LockBrokerException("interrupted while renewing '" + key + "'", e);
        }
        Map<String, Object> answer = Json.parseObject(response.body());
        int status = response.statusCode();
        if (status == 200) {
            synchronized (this) {
                trouble = null;
            }
            renewed(sent, answer);
            return;
        }
        if (ends(status)) {
            lost(lossBy(status, answer), gone(status));
            throw new LeaseLostException(describeLoss());
        }
        if (Http.retryable(status)) {
            throw broker.http.unavailable("renew '" + key + "'", response, answer);
        }
        throw broker.http.refusal("renew '" + key + "'", response, answer);
    }

    /**
     * Releases the lease: stops the background renewal first (waiting for one under way), then
     * {@code DELETE}s it with the token. Idempotent; quiet when the lease was already gone
     * ({@code 404}/{@code 409}); when the broker cannot be reached it retries for the release
     * timeout and gives up, logging a warning, as the lease then ends by its ttl. A lease of
     * several keys releases them all with one {@code DELETE /locks?keys=...}.
     */
    @Override
    public void release() {
        if (group != null) {
            group.release();
        } else {
            releaseOne();
        }
    }

    @Override
    void releaseOne() {
        if (stop()) {
            delete();
        }
    }

    /**
     * Stops the renewal for good (waiting for one under way) and marks the lease released;
     * true when a {@code DELETE} is still to be sent (not released before, not known gone).
     */
    boolean stop() {
        CompletableFuture<?> inFlight;
        boolean send;
        synchronized (this) {
            if (state == State.RELEASED || releaseSent) {
                return false;
            }
            send = !(state == State.LOST && lostForSure);
            state = state == State.LOST ? State.LOST : State.RELEASED;
            releaseSent = true;
            cancelTimers();
            inFlight = renewing;
        }
        broker.open.remove(this);
        if (session != null) {
            session.forget(this);
        }
        if (inFlight != null) {
            // No renewal may reach the broker after the release does.
            try {
                inFlight.get(broker.http.requestTimeout.toMillis() + 1000, TimeUnit.MILLISECONDS);
            } catch (InterruptedException e) {
                Thread.currentThread().interrupt();
            } catch (TimeoutException | java.util.concurrent.ExecutionException e) {
                // failed or hung: it can no longer renew anything that matters
            }
        }
        return send;
    }

    /** Same as {@link #release()}. */
    @Override
    public void close() {
        release();
    }

    @Override
    public String toString() {
        String s;
        synchronized (this) {
            s = state == State.HELD ? "held" : state == State.LOST ? "lost" : "released";
        }
        List<Long> fences = new ArrayList<>();
        for (Lease part : parts()) {
            fences.add(part.fence);
        }
        return "Lease[" + (group == null ? "key=" + key : "keys=" + keys()) + ", kind=" + kind
                + (kind == Kind.PERMIT ? ", limit=" + limit : "")
                + (group == null ? ", fence=" + fence : ", fences=" + fences) + (session != null ? ", under a session" : "") + ", " + s + "]";
    }
}
