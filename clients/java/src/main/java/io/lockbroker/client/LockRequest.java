package io.lockbroker.client;

import java.time.Duration;
import java.util.ArrayList;
import java.util.LinkedHashMap;
import java.util.LinkedHashSet;
import java.util.List;
import java.util.Map;
import java.util.Optional;

/**
 * One acquire, with every option: {@code broker.lock("k").shared().owner("node-7")
 * .ttl(Duration.ofSeconds(10)).maxWait(Duration.ofSeconds(2)).acquire()}. Defaults: a 30 s ttl,
 * no wait, renewed in the background, the broker's default owner label.
 *
 * <p>{@link #acquire()} sends one request with a generated {@code request_id} and lets the
 * broker wait. On {@code 503} or a failed connection it asks again with the same
 * {@code request_id} (so a grant made meanwhile comes back instead of a second one) after the
 * broker's {@code Retry-After} or a short backoff, until the wait has run out. A grant that came
 * back only on a retry is confirmed with a renewal before it is returned; one the client could
 * not confirm, or an outcome it never learnt, is released in the background.
 *
 * <p>A request made by a {@link Session} ({@link Session#lock(String)}) takes the lease under
 * that session: no ttl of its own, no renewal of its own.
 */
public final class LockRequest {
    final LockBroker broker;
    final String key;
    final Lease.Kind kind;
    final int limit;
    /** Every key, for a request of several keys at once ({@code POST /locks}); null for one key. */
    final List<String> keys;
    /** The session the lease is taken under; null for a lease of its own. */
    final Session session;
    Duration ttl = Duration.ofSeconds(30);
    Duration wait = Duration.ZERO;
    String owner;
    boolean autoRenew = true;

    LockRequest(LockBroker broker, String key, Lease.Kind kind, int limit) {
        this(broker, key, kind, limit, null);
    }

    LockRequest(LockBroker broker, String key, Lease.Kind kind, int limit, Session session) {
        this(broker, key, null, kind, limit, session);
    }

    /** A request for every key of {@code keys} at once (1 to 64 distinct keys), exclusive. */
    LockRequest(LockBroker broker, List<String> keys, Session session) {
        this(broker, null, checkKeys(keys), Lease.Kind.EXCLUSIVE, 0, session);
    }

    private LockRequest(LockBroker broker, String key, List<String> keys, Lease.Kind kind, int limit,
            Session session) {
        this.broker = broker;
        this.keys = keys;
        this.key = keys != null ? keys.get(0) : Keys.check(key);
        this.kind = kind;
        this.limit = limit;
        this.session = session;
        if (session != null) {
            this.ttl = Duration.ofMillis(session.ttlMillis());
            this.autoRenew = false;
        }
    }

    /**
     * The lease's length; renewed by that much each time (default 30 s).
     *
     * @param ttl the lease's length
     * @return this request
     * @throws IllegalStateException for a request under a session (its lease lives as long as the session)
     */
    public LockRequest ttl(Duration ttl) {
        if (session != null) {
            throw new IllegalStateException("a lease under a session has no ttl of its own");
        }
        this.ttl = ttl;
        return this;
    }

    /**
     * How long to wait while others hold the key (default: not at all).
     *
     * @param wait how long to wait
     * @return this request
     */
    public LockRequest maxWait(Duration wait) {
        this.wait = wait;
        return this;
    }

    /**
     * A shared (read) lease instead of an exclusive one; not for semaphores.
     *
     * @return a shared request with the same settings
     */
    public LockRequest shared() {
        if (kind == Lease.Kind.PERMIT) {
            throw new IllegalStateException("a semaphore permit has no shared mode");
        }
        return new LockRequest(broker, key, keys, Lease.Kind.SHARED, 0, session).copy(this);
    }

    /**
     * The label {@code GET /locks/{key}} shows for this lease, for people (at most 128 characters).
     *
     * @param owner the label
     * @return this request
     */
    public LockRequest owner(String owner) {
        this.owner = owner;
        return this;
    }

    /**
     * {@code false}: no background renewal; the lease ends after its ttl unless {@link Lease#renew()} is called.
     *
     * @param autoRenew whether the lease is renewed in the background (default true)
     * @return this request
     * @throws IllegalStateException for a request under a session (the session's keep-alive keeps its leases)
     */
    public LockRequest autoRenew(boolean autoRenew) {
        if (session != null) {
            throw new IllegalStateException("a lease under a session is kept by the session's keep-alive");
        }
        this.autoRenew = autoRenew;
        return this;
    }

    /**
     * Acquires, waiting up to {@link #maxWait(Duration)}.
     *
     * @return the lease
     * @throws LockedException not granted within the wait
     * @throws BrokerUnavailableException the broker could not be reached, or kept answering 503
     */
    public Lease acquire() {
        return broker.acquire(this);
    }

    /**
     * Acquires without waiting ({@code wait_ms=0}); empty when others hold it.
     *
     * @return the lease; empty when others hold it
     * @throws BrokerUnavailableException the broker could not be reached, or answered 503
     */
    public Optional<Lease> tryAcquire() {
        Duration saved = wait;
        wait = Duration.ZERO;
        try {
            return Optional.of(broker.acquire(this));
        } catch (LockedException e) {
            return Optional.empty();
        } finally {
            wait = saved;
        }
    }

    private LockRequest copy(LockRequest from) {
        this.ttl = from.ttl;
        this.wait = from.wait;
        this.owner = from.owner;
        this.autoRenew = from.autoRenew;
        return this;
    }

    /** The request for {@code k}, one of this request's keys, with its settings: one part of a lease of several keys. */
    LockRequest forKey(String k) {
        return new LockRequest(broker, k, null, kind, limit, session).copy(this);
    }

    /** The keys, quoted, for messages: {@code 'a'} or {@code 'a', 'b'}. */
    String quoted() {
        return keys == null ? "'" + key + "'" : "'" + String.join("', '", keys) + "'";
    }

    /** Where the acquire is sent: {@link #path()}, or {@code /locks} for several keys. */
    String acquirePath() {
        return keys == null ? path() : "/locks";
    }

    /** Where the token releases what the acquire granted: {@link #path()}, or {@code /locks?keys=a,b}. */
    String releasePath() {
        return keys == null ? path() : "/locks?keys=" + String.join(",", keys);
    }

    /** The "not granted" answer ({@code 409 locked}) as an exception: the busy keys, as the broker named them. */
    LockedException locked(Map<String, Object> answer, Duration retryAfter) {
        if (keys == null) {
            return new LockedException(key, retryAfter, broker.url);
        }
        List<String> held = new ArrayList<>();
        if (answer.get("held") instanceof List) {
            for (Object k : (List<?>) answer.get("held")) {
                held.add(String.valueOf(k));
            }
        }
        return new LockedException(keys, held, retryAfter, broker.url);
    }

    private static List<String> checkKeys(List<String> keys) {
        if (keys == null || keys.isEmpty() || keys.size() > 64) {
            throw new IllegalArgumentException("several keys at once means 1 to 64 keys, not "
                    + (keys == null ? "null" : keys.size()));
        }
        for (String k : keys) {
            Keys.check(k);
        }
        if (new LinkedHashSet<>(keys).size() != keys.size()) {
            throw new IllegalArgumentException("the same key twice in " + keys);
        }
        return List.copyOf(keys);
    }

    /** {@code /locks/KEY} or {@code /semaphores/KEY}, the key percent-encoded. */
    String path() {
        String space = kind == Lease.Kind.PERMIT ? "/semaphores/" : "/locks/";
        return space + key; // checked by Keys: nothing in it needs escaping
    }

    Map<String, Object> body(long ttlMs, long waitMs, String requestId, String defaultOwner) {
        Map<String, Object> body = new LinkedHashMap<>();
        if (session == null) {
            body.put("ttl_ms", ttlMs);
        } else {
            body.put("session", session.secret()); // in the body: never in a URL, where logs would show it
        }
        if (keys != null) {
            body.put("keys", keys);
        }
        body.put("wait_ms", waitMs);
        body.put("request_id", requestId);
        body.put("owner", owner != null ? owner : defaultOwner);
        if (kind == Lease.Kind.SHARED) {
            body.put("mode", "shared");
        }
        if (kind == Lease.Kind.PERMIT) {
            body.put("limit", (long) limit);
        }
        return body;
    }
}
