package io.lockbroker.client;

import java.time.Duration;
import java.util.List;

/**
 * Not granted: someone else still held the lock (or every permit) when the wait ran out
 * ({@code 409 locked}). For several keys at once ({@link LockBroker#acquireAll(List, Duration,
 * Duration)}), none of them is held afterwards, and {@link #heldKeys()} names the busy ones.
 */
public class LockedException extends LockBrokerException {
    private static final long serialVersionUID = 1L;

    /**
     * The key that was not granted.
     */
    private final String key;
    /**
     * The keys that were busy.
     */
    private final List<String> heldKeys;
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
        this.heldKeys = List.of(key);
        this.retryAfter = retryAfter;
    }

    /**
     * A "not granted" for several keys at once, from the broker at {@code url}.
     *
     * @param keys the keys asked for
     * @param heldKeys the keys that were busy, as the broker named them (may be empty)
     * @param retryAfter time until the current lease ends, as the broker said; null if it did not
     * @param url the broker's URL, for the message; null to leave it out
     */
    public LockedException(List<String> keys, List<String> heldKeys, Duration retryAfter, String url) {
        super("not every one of " + keys + " could be had" + (heldKeys.isEmpty() ? "" : ": " + heldKeys
                + (heldKeys.size() == 1 ? " is" : " are") + " held by someone else")
                + (url == null ? "" : " (broker " + url + ")")
                + (retryAfter == null ? "" : "; a current lease ends in " + retryAfter.toMillis() + " ms"),
                409, "locked", null);
        this.key = heldKeys.isEmpty() ? keys.get(0) : heldKeys.get(0);
        this.heldKeys = List.copyOf(heldKeys);
        this.retryAfter = retryAfter;
    }

    /**
     * The key that was not granted; for several keys, the first busy one.
     *
     * @return the key
     */
    public String key() {
        return key;
    }

    /**
     * The keys that were busy: {@link #key()} alone for one key; for several keys at once, the
     * ones the broker named (none of the keys asked for is held after this answer).
     *
     * @return the busy keys
     */
    public List<String> heldKeys() {
        return heldKeys;
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
