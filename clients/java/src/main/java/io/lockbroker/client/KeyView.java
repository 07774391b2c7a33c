package io.lockbroker.client;

import java.time.Instant;
import java.util.List;
import java.util.Map;
import java.util.Optional;

/**
 * What a watch, an inspect or a listing saw of a lock or semaphore: who holds it (never a token)
 * and, for a watch, whether that differs from the fence the watch was given. A free key has
 * {@link #fence()} 0 and no owner.
 */
public final class KeyView {
    private final String key;
    private final boolean held;
    private final long fence;
    private final String owner;
    private final Instant expiresAt;
    private final String mode;
    private final int holders;
    private final int limit;
    private final boolean changed;

    private KeyView(String key, boolean held, long fence, String owner, Instant expiresAt, String mode,
            int holders, int limit, boolean changed) {
        this.key = key;
        this.held = held;
        this.fence = fence;
        this.owner = owner;
        this.expiresAt = expiresAt;
        this.mode = mode;
        this.holders = holders;
        this.limit = limit;
        this.changed = changed;
    }

    /**
     * A view from a watch's or an inspect's {@code 200} body or a listing's entry (held), or from
     * a {@code 404 not_held} body (free). A semaphore's inspect has no top-level fence or end:
     * they are its permits' highest.
     */
    static KeyView of(String key, boolean held, Map<String, Object> body) {
        boolean changed = Boolean.TRUE.equals(body.get("changed"));
        if (!held) {
            return new KeyView(key, false, 0, null, null, null, 0, 0, changed);
        }
        Long fence = Json.numberField(body, "fence");
        Long expires = Json.numberField(body, "expires_at_ms");
        Object list = body.get("holders");
        int count = 1;
        if (list instanceof List) {
            count = ((List<?>) list).size();
            for (Object holder : (List<?>) list) {
                if (holder instanceof Map) {
                    @SuppressWarnings("unchecked")
                    Map<String, Object> h = (Map<String, Object>) holder;
                    fence = max(fence, Json.numberField(h, "fence"));
                    expires = max(expires, Json.numberField(h, "expires_at_ms"));
                }
            }
        } else if (list instanceof Number) {
            count = ((Number) list).intValue(); // a listed semaphore: its permits taken
        }
        Long limit = Json.numberField(body, "limit");
        return new KeyView(key, true, fence == null ? 0 : fence, Json.stringField(body, "owner"),
                expires == null ? null : Instant.ofEpochMilli(expires), Json.stringField(body, "mode"),
                count, limit == null ? 0 : limit.intValue(), changed);
    }

    private static Long max(Long a, Long b) {
        return a == null ? b : b == null ? a : Long.valueOf(Math.max(a, b));
    }

    /**
     * The key watched.
     *
     * @return the key
     */
    public String key() {
        return key;
    }

    /**
     * Whether anyone holds the key (or, for a semaphore, any permit).
     *
     * @return true while a lease (or a permit) holds it
     */
    public boolean isHeld() {
        return held;
    }

    /**
     * The holder's fence (for shared holders or a semaphore's permits, the highest); 0 when the
     * key is free. Pass it to the next watch to wait for a change from this view.
     *
     * @return the fence, or 0 when free
     */
    public long fence() {
        return fence;
    }

    /**
     * The holder's {@code owner} label; empty when free, when it gave none, or for shared holders and permits.
     *
     * @return the owner label, if there is one
     */
    public Optional<String> owner() {
        return Optional.ofNullable(owner);
    }

    /**
     * When the last lease ends unless renewed, on the broker's (store's) clock; empty when free.
     *
     * @return the end, if held
     */
    public Optional<Instant> expiresAt() {
        return Optional.ofNullable(expiresAt);
    }

    /**
     * {@code "exclusive"} or {@code "shared"} for a held lock; empty when free or for a semaphore.
     *
     * @return the mode, if a lock is held
     */
    public Optional<String> mode() {
        return Optional.ofNullable(mode);
    }

    /**
     * How many leases hold the key.
     *
     * @return 1 for an exclusive lock, the shared holders or permits taken otherwise, 0 when free
     *     (a listing does not count a shared lock's holders: 1 there)
     */
    public int holders() {
        return holders;
    }

    /**
     * A semaphore's limit, as its holders took their permits.
     *
     * @return the limit; 0 for a lock or a free key
     */
    public int limit() {
        return limit;
    }

    /**
     * Whether this view differs from the fence the watch was given (false: the wait ran out first).
     *
     * @return true when the view differs from what the watch was given
     */
    public boolean changed() {
        return changed;
    }

    @Override
    public String toString() {
        return "KeyView[" + key + (held ? ", fence " + fence + (owner == null ? "" : ", owner " + owner)
                + ", " + holders + " holder(s)" : ", free") + (changed ? ", changed" : ", unchanged") + "]";
    }
}
