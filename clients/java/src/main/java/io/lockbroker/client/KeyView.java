package io.lockbroker.client;

import java.time.Instant;
import java.util.List;
import java.util.Map;
import java.util.Optional;

/**
 * What a watch saw of a lock or semaphore: who holds it (never a token) and whether that
 * differs from the fence the watch was given. A free key has {@link #fence()} 0 and no owner.
 */
public final class KeyView {
    private final String key;
    private final boolean held;
    private final long fence;
    private final String owner;
    private final Instant expiresAt;
    private final String mode;
    private final int holders;
    private final boolean changed;

    private KeyView(String key, boolean held, long fence, String owner, Instant expiresAt, String mode,
            int holders, boolean changed) {
        this.key = key;
        this.held = held;
        this.fence = fence;
        this.owner = owner;
        this.expiresAt = expiresAt;
        this.mode = mode;
        this.holders = holders;
        this.changed = changed;
    }

    /** A view from a watch's {@code 200} body (held) or its {@code 404 not_held} body (free). */
    static KeyView of(String key, boolean held, Map<String, Object> body) {
        boolean changed = Boolean.TRUE.equals(body.get("changed"));
        if (!held) {
            return new KeyView(key, false, 0, null, null, null, 0, changed);
        }
        Long fence = LockBroker.number(body, "fence");
        Long expires = LockBroker.number(body, "expires_at_ms");
        Object list = body.get("holders");
        int count = list instanceof List ? ((List<?>) list).size() : 1;
        return new KeyView(key, true, fence == null ? 0 : fence, LockBroker.string(body, "owner"),
                expires == null ? null : Instant.ofEpochMilli(expires), LockBroker.string(body, "mode"),
                count, changed);
    }

    /** The key watched. */
    public String key() {
        return key;
    }

    /** Whether anyone holds the key (or, for a semaphore, any permit). */
    public boolean isHeld() {
        return held;
    }

    /**
     * The holder's fence (for shared holders or a semaphore's permits, the highest); 0 when the
     * key is free. Pass it to the next watch to wait for a change from this view.
     */
    public long fence() {
        return fence;
    }

    /** The holder's {@code owner} label; empty when free, when it gave none, or for shared holders and permits. */
    public Optional<String> owner() {
        return Optional.ofNullable(owner);
    }

    /** When the last lease ends unless renewed, on the broker's (store's) clock; empty when free. */
    public Optional<Instant> expiresAt() {
        return Optional.ofNullable(expiresAt);
    }

    /** {@code "exclusive"} or {@code "shared"} for a held lock; empty when free or for a semaphore. */
    public Optional<String> mode() {
        return Optional.ofNullable(mode);
    }

    /** How many leases hold the key: 1 for an exclusive lock, the holders or permits otherwise, 0 when free. */
    public int holders() {
        return holders;
    }

    /** Whether this view differs from the fence the watch was given (false: the wait ran out first). */
    public boolean changed() {
        return changed;
    }

    @Override
    public String toString() {
        return "KeyView[" + key + (held ? ", fence " + fence + (owner == null ? "" : ", owner " + owner)
                + ", " + holders + " holder(s)" : ", free") + (changed ? ", changed" : ", unchanged") + "]";
    }
}
