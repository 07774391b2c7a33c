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
import java.util.concurrent.ScheduledFuture;
import java.util.concurrent.TimeUnit;
import java.util.concurrent.TimeoutException;

/**
 * What one successful acquire returns: a lease on a lock, a shared lock or a semaphore permit,
 * renewed in the background at a third of its ttl (by default) until {@link #release()}.
 *
 * <p>The lease is <em>lost</em>, once, when a renewal answers {@code 404}/{@code 409} (it was
 * force-released, or ended and was taken over) or when its end comes without a confirmed
 * renewal (the broker unreachable or answering 503). The client counts that end from the moment
 * it <em>sent</em> the acquire or renewal, less a margin (a tenth of the ttl, at most 1 s), so
 * the signal comes before the broker's end, not after it. Then {@link #isHeld()} turns false and
 * the {@link #onLost(Runnable)} callbacks run on a client thread. An application told its lease
 * is lost must stop writing; the {@link #fence()} it passed along with each write lets the
 * resource refuse the writes that were already on their way.
 *
 * <p>Ownership is this object (it holds the token), not a thread: any thread may release it.
 * The token is never shown by {@link #toString()} nor logged.
 */
public final class Lease implements AutoCloseable {
    /** What a lease is on. */
    public enum Kind {
        /** The lock, alone. */
        EXCLUSIVE,
        /** The lock, with other shared holders. */
        SHARED,
        /** One permit of a semaphore. */
        PERMIT
    }

    private enum State { HELD, LOST, RELEASED }

    private final LockBroker broker;
    private final String key;
    private final Kind kind;
    private final int limit;
    private final String path;
    private final String token;
    private final long fence;
    private final long ttlMs;
    private final boolean autoRenew;
    private final long marginNanos;

    // Guarded by this.
    private State state = State.HELD;
    /** nanoTime by which the lease surely ends at the broker: a send time plus the ttl. */
    private long end;
    private long expiresAtMs;
    private String lostReason;
    /** Lost after an answer that said so (404/409), rather than for want of one. */
    private boolean lostForSure;
    private boolean releaseSent;
    private final List<Runnable> onLost = new ArrayList<>();
    private ScheduledFuture<?> renewTask;
    private ScheduledFuture<?> lossTask;
    private CompletableFuture<?> renewing;
    private final Backoff backoff = new Backoff();

    Lease(LockBroker broker, LockRequest r, Map<String, Object> answer, long sentNanos, long askedTtlMs) {
        this.broker = broker;
        this.key = r.key;
        this.kind = r.kind;
        this.path = r.path();
        this.autoRenew = r.autoRenew;
        String t = LockBroker.string(answer, "token");
        Long f = LockBroker.number(answer, "fence");
        if (t == null || f == null) {
            throw new LockBrokerException("the broker's grant of '" + r.key + "' has no token or fence");
        }
        this.token = t;
        this.fence = f;
        Long ttl = LockBroker.number(answer, "ttl_ms");
        this.ttlMs = ttl != null && ttl > 0 ? ttl : askedTtlMs;
        Long lim = LockBroker.number(answer, "limit");
        this.limit = lim != null ? lim.intValue() : r.limit;
        Long exp = LockBroker.number(answer, "expires_at_ms");
        this.expiresAtMs = exp != null ? exp : 0;
        this.marginNanos = TimeUnit.MILLISECONDS.toNanos(Math.min(this.ttlMs / 10, 1000));
        this.end = sentNanos + TimeUnit.MILLISECONDS.toNanos(this.ttlMs);
    }

    /** The key (lock or semaphore name). */
    public String key() {
        return key;
    }

    /** The fence: greater than every fence granted before on this key. Pass it with every write. */
    public long fence() {
        return fence;
    }

    /** Exclusive, shared, or a semaphore permit. */
    public Kind kind() {
        return kind;
    }

    /** The semaphore's limit for a permit; 0 for a lock. */
    public int limit() {
        return limit;
    }

    /** The ttl each renewal asks for. */
    public Duration ttl() {
        return Duration.ofMillis(ttlMs);
    }

    /** When the lease ends by the broker's latest answer, on the store's clock. */
    public synchronized Instant expiresAt() {
        return Instant.ofEpochMilli(expiresAtMs);
    }

    /**
     * True while the lease is held: not released, not lost, and its end (as this client counts
     * it, conservatively) not passed.
     */
    public boolean isHeld() {
        synchronized (this) {
            if (state != State.HELD) {
                return false;
            }
            if (System.nanoTime() - lostAt() < 0) {
                return true;
            }
        }
        lost("its end came without a confirmed renewal", false);
        return false;
    }

    /** Throws {@link LeaseLostException} unless {@link #isHeld()}: a check before each write. */
    public void ensureHeld() {
        if (!isHeld()) {
            throw new LeaseLostException(describeLoss());
        }
    }

    /** Why the lease was lost, once it is. */
    public synchronized Optional<String> lostReason() {
        return Optional.ofNullable(lostReason);
    }

    /**
     * Runs {@code callback} once, on a client thread, when the lease is lost; at once, on the
     * calling thread, if it is lost already. Never after a release (that is not a loss).
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
     * Renews the lease now, for its ttl (the background renewal does this by itself).
     *
     * @throws LeaseLostException it was already lost or released, or the broker says it ended
     * @throws BrokerUnavailableException the broker could not be reached or answered 503
     */
    public void renew() {
        synchronized (this) {
            if (state != State.HELD) {
                throw new LeaseLostException(describeLoss());
            }
        }
        long sent = System.nanoTime();
        HttpResponse<String> response;
        try {
            response = broker.send("POST", path + "/renew", renewBody(), token, broker.requestTimeout);
        } catch (IOException e) {
            throw new BrokerUnavailableException("cannot reach the broker at " + broker.url + ": " + e, 0, null, e);
        } catch (InterruptedException e) {
            Thread.currentThread().interrupt();
            throw new LockBrokerException("interrupted while renewing '" + key + "'", e);
        }
        Map<String, Object> answer = Json.parseObject(response.body());
        int status = response.statusCode();
        if (status == 200) {
            renewed(sent, answer);
            return;
        }
        if (status == 404 || status == 409) {
            lost(lossBy(status, answer), true);
            throw new LeaseLostException(describeLoss());
        }
        if (status == 503 || status == 429 || status >= 500) {
            throw new BrokerUnavailableException("the broker answered " + status + " to a renewal of '" + key + "'",
                    status, LockBroker.string(answer, "error"), null);
        }
        throw LockBroker.refusal("renew '" + key + "'", status, answer);
    }

    /**
     * Releases the lease: stops the background renewal first (waiting for one under way), then
     * {@code DELETE}s it with the token. Idempotent; quiet when the lease was already gone
     * ({@code 404}/{@code 409}); when the broker cannot be reached it retries for the release
     * timeout and gives up, logging a warning, as the lease then ends by its ttl.
     */
    public void release() {
        CompletableFuture<?> inFlight;
        boolean send;
        synchronized (this) {
            if (state == State.RELEASED || releaseSent) {
                return;
            }
            send = !(state == State.LOST && lostForSure);
            state = state == State.LOST ? State.LOST : State.RELEASED;
            releaseSent = true;
            cancelTimers();
            inFlight = renewing;
        }
        broker.open.remove(this);
        if (inFlight != null) {
            // No renewal may reach the broker after the release does.
            try {
                inFlight.get(broker.requestTimeout.toMillis() + 1000, TimeUnit.MILLISECONDS);
            } catch (InterruptedException e) {
                Thread.currentThread().interrupt();
            } catch (TimeoutException | java.util.concurrent.ExecutionException e) {
                // failed or hung: it can no longer renew anything that matters
            }
        }
        if (send) {
            delete();
        }
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
        return "Lease[key=" + key + ", kind=" + kind + (kind == Kind.PERMIT ? ", limit=" + limit : "")
                + ", fence=" + fence + ", " + s + "]";
    }

    // ---------------------------------------------------------------------------------------
    // Background renewal and loss

    /** Starts the background renewal and the loss timer; called once the lease is returned. */
    void start() {
        synchronized (this) {
            if (state != State.HELD) {
                return;
            }
            scheduleLossCheck();
            if (autoRenew) {
                scheduleRenew(Math.min(renewEvery(), (lostAt() - System.nanoTime()) / 2));
            }
        }
    }

    /**
     * True when the lease's end, as counted from the request that may have made it, is less
     * than one renewal period away: a grant after a long wait, or one that came back on a retry.
     * Such a lease is renewed before it is returned, to learn a safe end.
     */
    synchronized boolean needsConfirmation() {
        return lostAt() - System.nanoTime() < renewEvery();
    }

    /**
     * Renews the lease to learn a safe end. True when a renewal was confirmed; retried (503,
     * network) while the lease may be live or the caller's deadline has not passed, at least once.
     */
    boolean confirm(long deadlineNanos) {
        Backoff pauses = new Backoff();
        boolean first = true;
        while (true) {
            long until;
            synchronized (this) {
                until = lostAt() - deadlineNanos > 0 ? lostAt() : deadlineNanos; // the later of the two
            }
            if (until - System.nanoTime() <= 0 && !first) {
                return false;
            }
            first = false;
            long sent = System.nanoTime();
            Long retryAfter = null;
            try {
                HttpResponse<String> response = broker.send("POST", path + "/renew", renewBody(), token,
                        broker.requestTimeout);
                if (response.statusCode() == 200) {
                    renewed(sent, Json.parseObject(response.body()));
                    return true;
                }
                if (response.statusCode() == 404 || response.statusCode() == 409) {
                    return false;
                }
                retryAfter = LockBroker.retryAfterMs(response);
            } catch (IOException e) {
                // retried below
            } catch (InterruptedException e) {
                Thread.currentThread().interrupt();
                return false;
            }
            if (until - System.nanoTime() <= 0 || !pauses.sleep(retryAfter, until)) {
                return false;
            }
        }
    }

    /** A grant not returned to the caller: released in the background, quietly. */
    void abandon() {
        synchronized (this) {
            state = State.RELEASED;
            releaseSent = true;
        }
        broker.inBackground(this::delete);
    }

    private long lostAt() {
        return end - marginNanos;
    }

    private long renewEvery() {
        return TimeUnit.MILLISECONDS.toNanos(Math.max(1, (long) (ttlMs * broker.renewFraction)));
    }

    private String renewBody() {
        return "{\"ttl_ms\":" + ttlMs + "}";
    }

    // Called with this locked.
    private void scheduleRenew(long delayNanos) {
        if (broker.isClosed() || broker.timer.isShutdown()) {
            return;
        }
        renewTask = broker.timer.schedule(this::renewInBackground, Math.max(0, delayNanos), TimeUnit.NANOSECONDS);
    }

    // Called with this locked.
    private void scheduleLossCheck() {
        if (lossTask != null) {
            lossTask.cancel(false);
        }
        if (broker.timer.isShutdown()) {
            return;
        }
        lossTask = broker.timer.schedule(this::checkLoss, Math.max(0, lostAt() - System.nanoTime()),
                TimeUnit.NANOSECONDS);
    }

    private void checkLoss() {
        isHeld();
    }

    private void renewInBackground() {
        synchronized (this) {
            if (state != State.HELD || renewing != null) {
                return;
            }
            long sent = System.nanoTime();
            // An answer that comes after the lease's end is of no use: the loss is signalled.
            long left = Math.max(lostAt() - sent, TimeUnit.MILLISECONDS.toNanos(100));
            Duration timeout = Duration.ofNanos(Math.min(left, broker.requestTimeout.toNanos()));
            CompletableFuture<HttpResponse<String>> call =
                    broker.sendAsync("POST", path + "/renew", renewBody(), token, timeout);
            renewing = call;
            call.whenComplete((response, error) -> renewAnswered(sent, response, error));
        }
    }

    private void renewAnswered(long sent, HttpResponse<String> response, Throwable error) {
        int status = response == null ? 0 : response.statusCode();
        Map<String, Object> answer = response == null ? Map.of() : Json.parseObject(response.body());
        if (status == 404 || status == 409) {
            synchronized (this) {
                renewing = null;
            }
            lost(lossBy(status, answer), true);
            return;
        }
        synchronized (this) {
            renewing = null;
            if (state != State.HELD) {
                return;
            }
            if (status == 200) {
                backoff.reset();
                renewed(sent, answer);
                scheduleRenew(sent + renewEvery() - System.nanoTime());
                return;
            }
            // 503, another error, or no answer: try again soon, while the lease may be live;
            // the loss timer fires if no renewal is confirmed in time.
            long pauseMs = backoff.pauseMs(response == null ? null : LockBroker.retryAfterMs(response));
            if (status != 503 && status != 429 && status < 500 && response != null) {
                LockBroker.warn("renewal of '" + key + "' refused with " + status + "; retrying until the lease ends");
            }
            long pause = Math.min(TimeUnit.MILLISECONDS.toNanos(pauseMs), Math.max(0, lostAt() - System.nanoTime()));
            scheduleRenew(pause);
        }
    }

    private void renewed(long sent, Map<String, Object> answer) {
        synchronized (this) {
            long newEnd = sent + TimeUnit.MILLISECONDS.toNanos(ttlMs);
            if (newEnd - end > 0) {
                end = newEnd;
            }
            Long exp = LockBroker.number(answer, "expires_at_ms");
            if (exp != null) {
                expiresAtMs = exp;
            }
            if (state == State.HELD) {
                scheduleLossCheck();
            }
        }
    }

    /** Marks the lease lost (once) and runs the callbacks on the client's callback thread. */
    private void lost(String reason, boolean forSure) {
        List<Runnable> toRun;
        synchronized (this) {
            if (state != State.HELD) {
                return;
            }
            state = State.LOST;
            lostReason = reason;
            lostForSure = forSure;
            cancelTimers();
            toRun = new ArrayList<>(onLost);
            onLost.clear();
        }
        if (!forSure) {
            // The broker may still count it held; if it comes back in time, let the key go.
            broker.open.remove(this);
            broker.inBackground(this::release);
        } else {
            broker.open.remove(this);
        }
        for (Runnable callback : toRun) {
            try {
                broker.callbacks.execute(() -> runCallback(callback));
            } catch (java.util.concurrent.RejectedExecutionException e) {
                runCallback(callback); // the client is closed: run it here rather than never
            }
        }
    }

    private void runCallback(Runnable callback) {
        try {
            callback.run();
        } catch (RuntimeException e) {
            LockBroker.warn("a lost-lease callback for '" + key + "' threw: " + e);
        }
    }

    // Called with this locked.
    private void cancelTimers() {
        if (renewTask != null) {
            renewTask.cancel(false);
            renewTask = null;
        }
        if (lossTask != null) {
            lossTask.cancel(false);
            lossTask = null;
        }
    }

    private String lossBy(int status, Map<String, Object> answer) {
        String code = LockBroker.string(answer, "error");
        return "a renewal was answered " + status + (code == null ? "" : " " + code);
    }

    private synchronized String describeLoss() {
        if (state == State.LOST) {
            return "the lease on '" + key + "' (fence " + fence + ") was lost: " + lostReason;
        }
        return "the lease on '" + key + "' (fence " + fence + ") was released";
    }

    /** DELETE with the token, retried on 503 and network errors for the release timeout. */
    private void delete() {
        long until = System.nanoTime() + broker.releaseTimeout.toNanos();
        Backoff pauses = new Backoff();
        while (true) {
            String trouble;
            Long retryAfter = null;
            try {
                HttpResponse<String> response = broker.send("DELETE", path, null, token, broker.requestTimeout);
                int status = response.statusCode();
                if (status == 204 || status == 200 || status == 404 || status == 409) {
                    return; // released, or already gone
                }
                if (status != 503 && status != 429 && status < 500) {
                    LockBroker.warn("release of '" + key + "' refused with " + status + " "
                            + LockBroker.string(Json.parseObject(response.body()), "error"));
                    return;
                }
                trouble = "answered " + status;
                retryAfter = LockBroker.retryAfterMs(response);
            } catch (IOException e) {
                trouble = "could not be reached: " + e;
            } catch (InterruptedException e) {
                Thread.currentThread().interrupt();
                return;
            }
            if (until - System.nanoTime() <= 0) {
                LockBroker.warn("could not release '" + key + "' (the broker " + trouble
                        + "); it ends by its ttl, as it is no longer renewed");
                return;
            }
            if (!pauses.sleep(retryAfter, until)) {
                return;
            }
        }
    }
}
