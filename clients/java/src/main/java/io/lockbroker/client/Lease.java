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
    private final List<Consumer<LockBrokerException>> onTrouble = new ArrayList<>();
    /** The last failed renewal since the last one that got through; null while they get through. */
    private LockBrokerException trouble;
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
     * The ttl each renewal asks for.
     *
     * @return the ttl
     */
    public Duration ttl() {
        return Duration.ofMillis(ttlMs);
    }

    /**
     * When the lease ends by the broker's latest answer, on the store's clock.
     *
     * @return the end, as of the last confirmed acquire or renewal
     */
    public synchronized Instant expiresAt() {
        return Instant.ofEpochMilli(expiresAtMs);
    }

    /**
     * True while the lease is held: not released, not lost, and its end (as this client counts
     * it, conservatively) not passed.
     *
     * @return true while held
     */
    public boolean isHeld() {
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
     * Renews the lease now, for its ttl (the background renewal does this by itself).
     *
     * @throws LeaseLostException it was already lost or released, or the broker says it ended
     *     ({@code 404}/{@code 409}), or refused the token ({@code 401}/{@code 403})
     * @throws BrokerUnavailableException the broker could not be reached or answered 503 (or 429,
     *     or a proxy's 502/504)
     * @throws LockBrokerException any other answer (the broker's {@code 400}, a 5xx that is not)
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
            throw broker.unreachable("renew '" + key + "'", e);
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
        if (LockBroker.retryable(status)) {
            throw broker.unavailable("renew '" + key + "'", response, answer);
        }
        throw broker.refusal("renew '" + key + "'", response, answer);
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
                if (!LockBroker.retryable(response.statusCode())) {
                    return false; // gone, refused, or an answer no retry would change
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
        if (ends(status)) {
            synchronized (this) {
                renewing = null;
            }
            lost(lossBy(status, answer), gone(status));
            return;
        }
        LockBrokerException failure = status == 200 ? null : renewalFailure(response, answer, error);
        List<Consumer<LockBrokerException>> toReport = List.of();
        synchronized (this) {
            renewing = null;
            if (state != State.HELD) {
                return;
            }
            if (status == 200) {
                backoff.reset();
                trouble = null;
                renewed(sent, answer);
                scheduleRenew(sent + renewEvery() - System.nanoTime());
                return;
            }
            // 503, another error, or no answer: try again soon, while the lease may be live;
            // the loss timer fires if no renewal is confirmed in time. (A 5xx that is not the
            // broker's is retried here too: nobody waits on this call, and the loss comes anyway.)
            if (trouble == null) {
                toReport = new ArrayList<>(onTrouble);
            }
            trouble = failure;
            long pauseMs = backoff.pauseMs(response == null ? null : LockBroker.retryAfterMs(response));
            if (response != null && status < 500 && !LockBroker.retryable(status)) {
                LockBroker.warn(failure.getMessage() + "; retrying until the lease ends");
            }
            long pause = Math.min(TimeUnit.MILLISECONDS.toNanos(pauseMs), Math.max(0, lostAt() - System.nanoTime()));
            scheduleRenew(pause);
        }
        for (Consumer<LockBrokerException> hook : toReport) {
            try {
                broker.callbacks.execute(() -> runTroubleHook(hook, failure));
            } catch (java.util.concurrent.RejectedExecutionException e) {
                // the client is closed: its leases are released, not in trouble
            }
        }
    }

    /** A failed background renewal as the error {@link #onTrouble(Consumer)} hooks get. */
    private LockBrokerException renewalFailure(HttpResponse<String> response, Map<String, Object> answer,
            Throwable error) {
        String what = "renew '" + key + "'";
        if (response != null) {
            return LockBroker.retryable(response.statusCode()) ? broker.unavailable(what, response, answer)
                    : broker.refusal(what, response, answer);
        }
        Throwable cause = error instanceof java.util.concurrent.CompletionException && error.getCause() != null
                ? error.getCause() : error;
        if (cause instanceof IOException) {
            return broker.unreachable(what, (IOException) cause);
        }
        return new BrokerUnavailableException("cannot " + what + " at " + broker.url + ": " + cause, 0, null, cause);
    }

    private void runTroubleHook(Consumer<LockBrokerException> hook, LockBrokerException failure) {
        try {
            hook.accept(failure);
        } catch (RuntimeException e) {
            LockBroker.warn("a renewal-trouble hook for '" + key + "' threw: " + e);
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
            onTrouble.clear();
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

    /** Whether a renewal's answer ends the lease: gone ({@code 404}/{@code 409}) or the bearer token refused. */
    private static boolean ends(int status) {
        return gone(status) || status == 401 || status == 403;
    }

    /** The broker says the lease is over: nobody ({@code 404}) or somebody else ({@code 409}) holds it. */
    private static boolean gone(int status) {
        return status == 404 || status == 409;
    }

    private String lossBy(int status, Map<String, Object> answer) {
        String code = LockBroker.string(answer, "error");
        if (code == null) {
            code = status == 401 ? "unauthorized" : status == 403 ? "forbidden"
                    : status == 404 ? "not_held" : status == 409 ? "not_owner" : null;
        }
        String message = LockBroker.string(answer, "message");
        return "a renewal was answered " + status + (code == null ? "" : " " + code)
                + (message == null ? "" : " (" + message + ")");
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
                if (!LockBroker.retryable(status)) {
                    LockBroker.warn(broker.refusal("release '" + key + "'", response, Json.parseObject(response.body()))
                            .getMessage() + "; it ends by its ttl, as it is no longer renewed");
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
                LockBroker.warn("could not release '" + key + "' at " + broker.url + " (the broker " + trouble
                        + "); it ends by its ttl, as it is no longer renewed");
                return;
            }
            if (!pauses.sleep(retryAfter, until)) {
                return;
            }
        }
    }
}
