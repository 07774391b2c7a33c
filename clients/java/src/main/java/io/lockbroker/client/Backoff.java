package io.lockbroker.client;

import java.util.concurrent.ThreadLocalRandom;
import java.util.concurrent.TimeUnit;

/**
 * The pause before trying a request again after a 503 or a failed connection: the broker's
 * {@code Retry-After} when it sent one, otherwise 50 ms doubling up to 1 s, moved by up to a
 * quarter either way so that clients do not retry in step. One per sequence of tries.
 */
final class Backoff {
    static final long FIRST_MS = 50;
    static final long MAX_MS = 1000;

    private long nextMs = FIRST_MS;

    /** The pause before the next try, in milliseconds. */
    long pauseMs(Long retryAfterMs) {
        if (retryAfterMs != null) {
            return retryAfterMs;
        }
        long base = nextMs;
        nextMs = Math.min(nextMs * 2, MAX_MS);
        long spread = base / 4;
        return base - spread + ThreadLocalRandom.current().nextLong(2 * spread + 1);
    }

    /** Back to the first pause, after a success. */
    void reset() {
        nextMs = FIRST_MS;
    }

    /**
     * Sleeps for the next pause, but not past {@code untilNanos} ({@code System.nanoTime()});
     * false when interrupted (the thread's interrupt flag is set again).
     */
    boolean sleep(Long retryAfterMs, long untilNanos) {
        long pause = Math.min(pauseMs(retryAfterMs), TimeUnit.NANOSECONDS.toMillis(untilNanos - System.nanoTime()) + 1);
        try {
            Thread.sleep(Math.max(0, pause));
            return true;
        } catch (InterruptedException e) {
            Thread.currentThread().interrupt();
            return false;
        }
    }
}
