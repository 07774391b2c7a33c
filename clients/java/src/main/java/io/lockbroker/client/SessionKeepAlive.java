package io.lockbroker.client;

import java.io.IOException;
import java.net.http.HttpResponse;
import java.time.Duration;
import java.util.ArrayList;
import java.util.LinkedHashSet;
import java.util.List;
import java.util.Map;
import java.util.Set;
import java.util.concurrent.CompletableFuture;
import java.util.concurrent.ScheduledFuture;
import java.util.concurrent.TimeUnit;

/**
 * A {@link Session}'s life after it is opened: its state (guarded by the session), its
 * keep-alive and loss timer on the client's renewal timer, the loss itself (with the leases
 * under it and the callbacks), and the {@code DELETE} that closes it. {@link Session} adds the
 * public methods; it is the only class to extend this one.
 */
abstract class SessionKeepAlive {
    enum State { ALIVE, LOST, CLOSED }

    final LockBroker broker;
    final String id;
    final long ttlMs;
    final long lockDelayMs;
    final long marginNanos;

    // Guarded by this.
    State state = State.ALIVE;
    /** Lost after an answer that said so (404), rather than for want of one. */
    boolean lostForSure;
    boolean deleteSent;
    /** nanoTime by which the session surely ends at the broker: a confirmed send plus the ttl. */
    long end;
    long expiresAtMs;
    String lostReason;
    /** The last failed keep-alive since the last one that got through; null while they get through. */
    String trouble;
    final List<Runnable> onLost = new ArrayList<>();
    final Set<Lease> leases = new LinkedHashSet<>();
    ScheduledFuture<?> keepAliveTask;
    ScheduledFuture<?> lossTask;
    CompletableFuture<?> keepingAlive;
    final Backoff backoff = new Backoff();

    SessionKeepAlive(LockBroker broker, Map<String, Object> answer, long sentNanos, long askedTtlMs, long lockDelayMs) {
        this.broker = broker;
        String s = Json.stringField(answer, "session");
        if (s == null || s.isEmpty()) {
            throw new LockBrokerException("the broker's answer to opening a session at " + broker.url + " has no session");
        }
        this.id = s;
        Long ttl = Json.numberField(answer, "ttl_ms");
        this.ttlMs = ttl != null && ttl > 0 ? ttl : askedTtlMs;
        Long delay = Json.numberField(answer, "lock_delay_ms");
        this.lockDelayMs = delay != null ? delay : lockDelayMs;
        Long exp = Json.numberField(answer, "expires_at_ms");
        this.expiresAtMs = exp != null ? exp : 0;
        this.marginNanos = TimeUnit.MILLISECONDS.toNanos(Math.min(this.ttlMs / 10, 1000));
        this.end = sentNanos + TimeUnit.MILLISECONDS.toNanos(this.ttlMs);
    }

    /**
     * True while the session lives; see {@link Session#isAlive()}.
     *
     * @return true while alive
     */
    abstract boolean isAlive();

    /** Closes the session; see {@link Session#close()}. */
    abstract void close();

    long lostAt() {
        return end - marginNanos;
    }

    long keepAliveEvery() {
        return TimeUnit.MILLISECONDS.toNanos(Math.max(1, (long) (ttlMs * broker.renewFraction)));
    }

    String path() {
        return "/sessions/" + id; // URL-safe characters only: nothing to escape
    }

    synchronized void start() {
        if (state != State.ALIVE) {
            return;
        }
        scheduleLossCheck();
        scheduleKeepAlive(Math.min(keepAliveEvery(), (lostAt() - System.nanoTime()) / 2));
    }

    // Called with this locked.
    void scheduleKeepAlive(long delayNanos) {
        if (broker.isClosed() || broker.workers.timer.isShutdown()) {
            return;
        }
        keepAliveTask = broker.workers.timer.schedule(this::keepAlive, Math.max(0, delayNanos), TimeUnit.NANOSECONDS);
    }

    // Called with this locked.
    void scheduleLossCheck() {
        if (lossTask != null) {
            lossTask.cancel(false);
        }
        if (broker.workers.timer.isShutdown()) {
            return;
        }
        lossTask = broker.workers.timer.schedule(this::isAlive, Math.max(0, lostAt() - System.nanoTime()),
                TimeUnit.NANOSECONDS);
    }

    // Called with this locked.
    void cancelTimers() {
        for (ScheduledFuture<?> task : new ScheduledFuture<?>[] {keepAliveTask, lossTask}) {
            if (task != null) {
                task.cancel(false);
            }
        }
        keepAliveTask = null;
        lossTask = null;
    }

    synchronized void keepAlive() {
        if (state != State.ALIVE || keepingAlive != null) {
            return;
        }
        long sent = System.nanoTime();
        // An answer that comes after the session's end is of no use: the loss is signalled.
        long left = Math.max(lostAt() - sent, TimeUnit.MILLISECONDS.toNanos(100));
        Duration timeout = Duration.ofNanos(Math.min(left, broker.http.requestTimeout.toNanos()));
        CompletableFuture<HttpResponse<String>> call = broker.http.sendAsync("POST", path() + "/renew",
                "{\"ttl_ms\":" + ttlMs + "}", null, timeout);
        keepingAlive = call;
        call.whenComplete((response, error) -> keptAlive(sent, response, error));
    }

    void keptAlive(long sent, HttpResponse<String> response, Throwable error) {
        int status = response == null ? 0 : response.statusCode();
        Map<String, Object> answer = response == null ? Map.of() : Json.parseObject(response.body());
        if (LeaseRenewal.ends(status)) {
            synchronized (this) {
                keepingAlive = null;
            }
            lost("a keep-alive was answered " + answered(response, answer), LeaseRenewal.gone(status));
            return;
        }
        synchronized (this) {
            keepingAlive = null;
            if (state != State.ALIVE) {
                return;
            }
            if (status == 200) {
                backoff.reset();
                trouble = null;
                long newEnd = sent + TimeUnit.MILLISECONDS.toNanos(ttlMs);
                if (newEnd - end > 0) {
                    end = newEnd;
                }
                Long exp = Json.numberField(answer, "expires_at_ms");
                if (exp != null) {
                    expiresAtMs = exp;
                }
                scheduleLossCheck();
                scheduleKeepAlive(sent + keepAliveEvery() - System.nanoTime());
                return;
            }
            // 503, another error, or no answer: try again soon, while the session may live;
            // the loss timer fires if no keep-alive is confirmed in time.
            trouble = response != null ? answered(response, answer) : "no answer: " + rootCause(error);
            long pauseMs = backoff.pauseMs(response == null ? null : Http.retryAfterMs(response));
            scheduleKeepAlive(Math.min(TimeUnit.MILLISECONDS.toNanos(pauseMs), Math.max(0, lostAt() - System.nanoTime())));
        }
    }

    /** "404 not_held (its message)": an answer, for a reason. */
    static String answered(HttpResponse<String> response, Map<String, Object> answer) {
        return Http.answered(response, answer).replaceFirst("^the broker answered ", "");
    }

    static Throwable rootCause(Throwable error) {
        return error instanceof java.util.concurrent.CompletionException && error.getCause() != null
                ? error.getCause() : error;
    }

    /** Marks the session lost (once), loses every lease under it, and runs the callbacks. */
    void lost(String reason, boolean forSure) {
        List<Runnable> toRun;
        List<Lease> under;
        synchronized (this) {
            if (state != State.ALIVE) {
                return;
            }
            state = State.LOST;
            lostReason = reason;
            lostForSure = forSure;
            cancelTimers();
            toRun = new ArrayList<>(onLost);
            onLost.clear();
            under = new ArrayList<>(leases);
            leases.clear();
        }
        broker.sessions.remove(this);
        for (Lease lease : under) {
            lease.lostWithSession("its session was lost: " + reason);
        }
        if (!forSure) {
            // The broker may still count it alive: if it comes back in time, let the keys go.
            broker.workers.inBackground(this::close);
        }
        broker.workers.runLostCallbacks(toRun, this::runCallback);
    }

    void runCallback(Runnable callback) {
        try {
            callback.run();
        } catch (RuntimeException e) {
            LockBroker.warn("a lost-session callback threw: " + e);
        }
    }

    /** DELETE the session, retried on 503 and network errors for the release timeout; never throws. */
    void delete() {
        String what = "close a session";
        long until = System.nanoTime() + broker.releaseTimeout.toNanos();
        Backoff pauses = new Backoff();
        String failure;
        try {
            while (true) {
                Long retryAfter = null;
                try {
                    HttpResponse<String> response = broker.http.send("DELETE", path(), null, null,
                            broker.http.requestTimeout);
                    int status = response.statusCode();
                    if (status == 204 || status == 200 || status == 404) {
                        return; // closed, or already ended
                    }
                    failure = broker.http.refusal(what, response, Json.parseObject(response.body())).getMessage();
                    if (!Http.retryable(status)) {
                        break;
                    }
                    retryAfter = Http.retryAfterMs(response);
                } catch (IOException e) {
                    failure = "cannot " + what + ": cannot reach the broker at " + broker.url + ": " + e;
                }
                if (until - System.nanoTime() <= 0 || !pauses.sleep(retryAfter, until)) {
                    break;
                }
            }
        } catch (InterruptedException e) {
            Thread.currentThread().interrupt();
            failure = "interrupted while trying to " + what;
        } catch (RuntimeException e) {
            failure = "cannot " + what + " at " + broker.url + ": " + e; // the client closed meanwhile, say
        }
        LockBroker.warn(failure + "; its leases end with its ttl, as it is no longer kept alive");
    }
}

