package io.lockbroker.client;

import java.util.List;
import java.util.Optional;

/**
 * One page of a listing ({@link LockBroker#listLocks(String, int, String) listLocks},
 * {@link LockBroker#listSemaphores(String, int, String) listSemaphores}): the held keys on it, in key order, and
 * the cursor of the next page.
 */
public final class KeyListing {
    private final List<KeyView> keys;
    private final String nextCursor;

    KeyListing(List<KeyView> keys, String nextCursor) {
        this.keys = List.copyOf(keys);
        this.nextCursor = nextCursor;
    }

    /**
     * The held keys on this page, in key order.
     *
     * @return their views (each {@link KeyView#isHeld()})
     */
    public List<KeyView> keys() {
        return keys;
    }

    /**
     * What to give as {@code cursor} for the next page.
     *
     * @return the cursor; empty on the last page
     */
    public Optional<String> nextCursor() {
        return Optional.ofNullable(nextCursor);
    }

    @Override
    public String toString() {
        return "KeyListing[" + keys.size() + " key(s)" + (nextCursor == null ? "" : ", more") + "]";
    }
}
