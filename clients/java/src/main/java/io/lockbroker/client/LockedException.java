package io.lockbroker.client;

import java.time.Duration;

/**
 * Not granted: someone else still held the lock (or every permit) when the wait ran out
 * ({@code 409 locked}).
 */
public class LockedException extends LockBrokerException {
    private static final long serialVersionUID = 1L;

    private final String key;
    private final Duration retryAfter;

    public LockedException(String key, Duration retryAfter) {
        super("'" + key + "' is held by someone else"
                + (retryAfter == null ? "" : "; the current lease ends in " + retryAfter.toMillis() + " ms"),
                409, "locked", null);
        this.key = key;
        this.retryAfter = retryAfter;
    }

    /** The key that was not granted. */
    public String key() {
        return key;
    }

    /** Time until the current holder's lease ends, as the broker said; null if it did not. */
    public Duration retryAfter() {
        return retryAfter;
    }
}
