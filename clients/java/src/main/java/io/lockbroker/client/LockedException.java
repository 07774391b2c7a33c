package io.lockbroker.client;

import java.time.Duration;

/**
 * Not granted: someone else still held the lock (or every permit) when the wait ran out
 * ({@code 409 locked}).
 */
public class LockedException extends LockBrokerException {
    private static final long serialVersionUID = 1L;

    /**
     * The key that was not granted.
     */
    private final String key;
    /**
     * Time until the current holder's lease ends; null when not said.
     */
    private final Duration retryAfter;

    /**
     * A "not granted" for {@code key}.
     *
     * @param key the key
     * @param retryAfter time until the current lease ends, as the broker said; null if it did not
     */
    public LockedException(String key, Duration retryAfter) {
        this(key, retryAfter, null);
    }

    /**
     * A "not granted" for {@code key}, from the broker at {@code url}.
     *
     * @param key the key
     * @param retryAfter time until the current lease ends, as the broker said; null if it did not
     * @param url the broker's URL, for the message; null to leave it out
     */
    public LockedException(String key, Duration retryAfter, String url) {
        super("'" + key + "' is held by someone else" + (url == null ? "" : " (broker " + url + ")")
                + (retryAfter == null ? "" : "; the current lease ends in " + retryAfter.toMillis() + " ms"),
                409, "locked", null);
        this.key = key;
        this.retryAfter = retryAfter;
    }

    /**
     * The key that was not granted.
     *
     * @return the key
     */
    public String key() {
        return key;
    }

    /**
     * Time until the current holder's lease ends, as the broker said; null if it did not.
     *
     * @return the time, or null
     */
    public Duration retryAfter() {
        return retryAfter;
    }
}
