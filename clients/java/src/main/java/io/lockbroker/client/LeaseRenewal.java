package io.lockbroker.client;

import java.io.IOException;
import java.net.http.HttpResponse;
import java.time.Duration;
import java.util.ArrayList;
import java.util.List;
import java.util.Map;
import java.util.concurrent.CompletableFuture;
import java.util.concurrent.ScheduledFuture;
import java.util.concurrent.TimeUnit;
import java.util.function.Consumer;

/**
 * A {@link Lease}'s life after the grant: its state (guarded by the lease), its background
 * renewal and loss timer, the loss itself with its callbacks, and the {@code DELETE} that
 * releases it. {@link Lease} adds the public methods; it is the only class to extend this one.
 */
abstract class LeaseRenewal {
    enum State { HELD, LOST, RELEASED }

    final LockBroker broker;
    final String key;
    final Lease.Kind kind;
    final int limit;
    final String path;
    final String token;
    final long fence;
    final long ttlMs;
    final boolean autoRenew;
    final long marginNanos;
    /** The session the lease is under (kept by its keep-alive, lost with it); null for a lease of its own. */
    final Session session;
    /** The lease of several keys this is one part of (set before it is returned); null for a lease of one key. */
    LeaseGroup group;

    // Guarded by this.
    State state = State.HELD;
    /** nanoTime by which the lease surely ends at the broker: a send time plus the ttl. */
    long end;
    long expiresAtMs;
    String lostReason;
    /** Lost after an answer that said so (404/409), rather than for want of one. */
    boolean lostForSure;
    boolean releaseSent;
    final List<Runnable> onLost = new ArrayList<>();
    final List<Consumer<LockBrokerException>> onTrouble = new ArrayList<>();
    /** The last failed renewal since the last one that got through; null while they get through. */
    LockBrokerException trouble;
    ScheduledFuture<?> renewTask;
    ScheduledFuture<?> lossTask;
    CompletableFuture<?> renewing;
    final Backoff backoff = new Backoff();

    LeaseRenewal(LockBroker broker, LockRequest r, Map<String, Object> answer, long sentNanos, long askedTtlMs) {
        this.broker = broker;
        this.key = r.key;
        this.kind = r.kind;
        this.path = r.path();
        this.autoRenew = r.autoRenew;
        this.session = r.session;
        String t = Json.stringField(answer, "token");
        Long f = Json.numberField(answer, "fence");
        if (t == null || f == null) {
            throw new LockBrokerException("the broker's grant of '" + r.key + "' has no token or fence");
        }
        this.token = t;
        this.fence = f;
        Long ttl = Json.numberField(answer, "ttl_ms");
        this.ttlMs = ttl != null && ttl > 0 ? ttl : askedTtlMs;
        Long lim = Json.numberField(answer, "limit");
        this.limit = lim != null ? lim.intValue() : r.limit;
        Long exp = Json.numberField(answer, "expires_at_ms");
        this.expiresAtMs = exp != null ? exp : 0;
        this.marginNanos = TimeUnit.MILLISECONDS.toNanos(Math.min(this.ttlMs / 10, 1000));
        this.end = sentNanos + TimeUnit.MILLISECONDS.toNanos(this.ttlMs);
    }

    /**
     * True while the lease is held; see {@link Lease#isHeld()}.
     *
     * @return true while held
     */
    public abstract boolean isHeld();

    /** Releases the lease; see {@link Lease#release()}. */
    public abstract void release();

    /** Releases this key alone (of a lease of several keys: this part). */
    abstract void releaseOne();

    // ---------------------------------------------------------------------------------------
    // Background renewal and loss

    /** Starts the background renewal and the loss timer; called once the lease is returned. */
    void start() {
        synchronized (this) {
            if (state != State.HELD || session != null) {
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
        return session == null && lostAt() - System.nanoTime() < renewEvery();
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
                HttpResponse<String> response = broker.http.send("POST", path + "/renew", renewBody(), token,
                        broker.http.requestTimeout);
                if (response.statusCode() == 200) {
                    renewed(sent, Json.parseObject(response.body()));
                    return true;
                }
                if (!Http.retryable(response.statusCode())) {
                    return false; // gone, refused, or an answer no retry would change
                }
                retryAfter = Http.retryAfterMs(response);
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
        broker.workers.inBackground(this::delete);
    }

    long lostAt() {
        return end - marginNanos;
    }

    private long renewEvery() {
        return TimeUnit.MILLISECONDS.toNanos(Math.max(1, (long) (ttlMs * broker.renewFraction)));
    }

    /** A renewal's body: the ttl again; none under a session (the answer is the session's end). */
    String renewBody() {
        return session != null ? null : "{\"ttl_ms\":" + ttlMs + "}";
    }

    // Called with this locked.
    private void scheduleRenew(long delayNanos) {
        if (broker.isClosed() || broker.workers.timer.isShutdown()) {
            return;
        }
        renewTask = broker.workers.timer.schedule(this::renewInBackground, Math.max(0, delayNanos),
                TimeUnit.NANOSECONDS);
    }

    // Called with this locked.
    private void scheduleLossCheck() {
        if (lossTask != null) {
            lossTask.cancel(false);
        }
        if (session != null || broker.workers.timer.isShutdown()) {
            return;
        }
        lossTask = broker.workers.timer.schedule(this::checkLoss, Math.max(0, lostAt() - System.nanoTime()),
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
            Duration timeout = Duration.ofNanos(Math.min(left, broker.http.requestTimeout.toNanos()));
            CompletableFuture<HttpResponse<String>> call =
                    broker.http.sendAsync("POST", path + "/renew", renewBody(), token, timeout);
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
            long pauseMs = backoff.pauseMs(response == null ? null : Http.retryAfterMs(response));
            if (response != null && status < 500 && !Http.retryable(status)) {
                LockBroker.warn(failure.getMessage() + "; retrying until the lease ends");
            }
            long pause = Math.min(TimeUnit.MILLISECONDS.toNanos(pauseMs), Math.max(0, lostAt() - System.nanoTime()));
            scheduleRenew(pause);
        }
        for (Consumer<LockBrokerException> hook : toReport) {
            try {
                broker.workers.callbacks.execute(() -> runTroubleHook(hook, failure));
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
            return Http.retryable(response.statusCode()) ? broker.http.unavailable(what, response, answer)
                    : broker.http.refusal(what, response, answer);
        }
        Throwable cause = error instanceof java.util.concurrent.CompletionException && error.getCause() != null
                ? error.getCause() : error;
        if (cause instanceof IOException) {
            return broker.http.unreachable(what, (IOException) cause);
        }
        return new BrokerUnavailableException("cannot " + what + " at " + broker.url + ": " + cause, 0, null, cause);
    }

    void runTroubleHook(Consumer<LockBrokerException> hook, LockBrokerException failure) {
        try {
            hook.accept(failure);
        } catch (RuntimeException e) {
            LockBroker.warn("a renewal-trouble hook for '" + key + "' threw: " + e);
        }
    }

    void renewed(long sent, Map<String, Object> answer) {
        synchronized (this) {
            long newEnd = sent + TimeUnit.MILLISECONDS.toNanos(ttlMs);
            if (newEnd - end > 0) {
                end = newEnd;
            }
            Long exp = Json.numberField(answer, "expires_at_ms");
            if (exp != null) {
                expiresAtMs = exp;
            }
            if (state == State.HELD) {
                scheduleLossCheck();
            }
        }
    }

    /** Marks the lease lost (once) and runs the callbacks on the client's callback thread. */
    void lost(String reason, boolean forSure) {
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
        if (session != null) {
            session.forget((Lease) this);
        }
        if (!forSure) {
            // The broker may still count it held; if it comes back in time, let the key go.
            broker.open.remove(this);
            broker.workers.inBackground(this::releaseOne);
        } else {
            broker.open.remove(this);
        }
        broker.workers.runLostCallbacks(toRun, this::runCallback);
        if (group != null) {
            group.lost((Lease) this, reason);
        }
    }

    /** Its session was lost: so is the lease (nothing to release: the session's end ends it). */
    void lostWithSession(String reason) {
        lost(reason, true);
    }

    /** Its session was closed, which released the lease at the broker. */
    void releasedWithSession() {
        synchronized (this) {
            if (state == State.HELD) {
                state = State.RELEASED;
            }
            releaseSent = true;
            cancelTimers();
        }
    }

    void runCallback(Runnable callback) {
        try {
            callback.run();
        } catch (RuntimeException e) {
            LockBroker.warn("a lost-lease callback for '" + key + "' threw: " + e);
        }
    }

    // Called with this locked.
    void cancelTimers() {
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
    static boolean ends(int status) {
        return gone(status) || status == 401 || status == 403;
    }

    /** The broker says the lease is over: nobody ({@code 404}) or somebody else ({@code 409}) holds it. */
    static boolean gone(int status) {
        return status == 404 || status == 409;
    }

    String lossBy(int status, Map<String, Object> answer) {
        String code = Json.stringField(answer, "error");
        if (code == null) {
            code = status == 401 ? "unauthorized" : status == 403 ? "forbidden"
                    : status == 404 ? "not_held" : status == 409 ? "not_owner" : null;
        }
        String message = Json.stringField(answer, "message");
        return "a renewal was answered " + status + (code == null ? "" : " " + code)
                + (message == null ? "" : " (" + message + ")");
    }

    synchronized String describeLoss() {
        if (state == State.LOST) {
            return "the lease on '" + key + "' (fence " + fence + ") was lost: " + lostReason;
        }
        return "the lease on '" + key + "' (fence " + fence + ") was released";
    }

    /** DELETE with the token, retried on 503 and network errors for the release timeout. */
    void delete() {
        deleteAt(path, "'" + key + "'", System.nanoTime() + broker.releaseTimeout.toNanos());
    }

    /**
     * {@code DELETE at} with the token, retried on 503 and network errors until {@code until}.
     * Returns the answer when it was 200 (several keys: each key's status), else an empty map.
     */
    Map<String, Object> deleteAt(String at, String what, long until) {
        Backoff pauses = new Backoff();
        while (true) {
            String trouble;
            Long retryAfter = null;
            try {
                HttpResponse<String> response = broker.http.send("DELETE", at, null, token,
                        broker.http.requestTimeout);
                int status = response.statusCode();
                if (status == 204 || status == 200 || status == 404 || status == 409) {
                    return status == 200 ? Json.parseObject(response.body()) : Map.of(); // released, or already gone
                }
                if (!Http.retryable(status)) {
                    LockBroker.warn(broker.http.refusal("release " + what, response,
                            Json.parseObject(response.body()))
                            .getMessage() + "; it ends by its ttl, as it is no longer renewed");
                    return Map.of();
                }
                trouble = "answered " + status;
                retryAfter = Http.retryAfterMs(response);
            } catch (IOException e) {
                trouble = "could not be reached: " + e;
            } catch (InterruptedException e) {
                Thread.currentThread().interrupt();
                return Map.of();
            }
            if (until - System.nanoTime() <= 0) {
                LockBroker.warn("could not release " + what + " at " + broker.url + " (the broker " + trouble
                        + "); it ends by its ttl, as it is no longer renewed");
                return Map.of();
            }
            if (!pauses.sleep(retryAfter, until)) {
                return Map.of();
            }
        }
    }
}
