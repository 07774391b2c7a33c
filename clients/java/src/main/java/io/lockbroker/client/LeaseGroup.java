package io.lockbroker.client;

import java.util.ArrayList;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;
import java.util.concurrent.atomic.AtomicBoolean;

/**
 * A lease of several keys at once ({@code POST /locks} with {@code "keys"}): one {@link Lease}
 * per key (its parts), all with the one token, each renewed (and timed) as a lease of its own;
 * the first part is the lease the caller gets. Losing any part loses them all (the others are
 * released); releasing the first releases them all, with one {@code DELETE /locks?keys=...}.
 */
final class LeaseGroup {
    /** One lease per key, in the order of the keys asked for. */
    final List<Lease> parts;
    private final LockBroker broker;
    private final AtomicBoolean lost = new AtomicBoolean();

    private LeaseGroup(LockBroker broker, List<Lease> parts) {
        this.broker = broker;
        this.parts = List.copyOf(parts);
    }

    /**
     * The lease a {@code 201} grants: for one key, a {@link Lease}; for several, the first key's
     * lease of a new group, its parts made from the answer's {@code "leases"} (a fence each).
     */
    static Lease granted(LockBroker broker, LockRequest r, Map<String, Object> answer, long sentNanos,
            long askedTtlMs) {
        if (r.keys == null) {
            return new Lease(broker, r, answer, sentNanos, askedTtlMs);
        }
        Object leases = answer.get("leases");
        List<?> granted = leases instanceof List ? (List<?>) leases : List.of();
        if (granted.size() != r.keys.size()) {
            throw new LockBrokerException("the broker's grant of " + r.quoted() + " has " + granted.size()
                    + " leases, not " + r.keys.size());
        }
        List<Lease> parts = new ArrayList<>();
        for (int i = 0; i < granted.size(); i++) {
            @SuppressWarnings("unchecked")
            Map<String, Object> one = granted.get(i) instanceof Map ? (Map<String, Object>) granted.get(i) : Map.of();
            String key = r.keys.get(i);
            if (!key.equals(Json.stringField(one, "key"))) {
                throw new LockBrokerException("the broker's grant of " + r.quoted() + " names '"
                        + Json.stringField(one, "key") + "' where '" + key + "' was expected");
            }
            Map<String, Object> part = new LinkedHashMap<>(answer);
            part.remove("leases");
            part.put("fence", Json.numberField(one, "fence"));
            parts.add(new Lease(broker, r.forKey(key), part, sentNanos, askedTtlMs));
        }
        LeaseGroup group = new LeaseGroup(broker, parts);
        for (Lease part : parts) {
            part.group = group;
        }
        return parts.get(0);
    }

    /**
     * A part was lost: so is every other one (once), each released in the background, unless
     * their session has ended (which ended them all at the broker).
     */
    void lost(Lease from, String reason) {
        if (!lost.compareAndSet(false, true)) {
            return;
        }
        boolean sessionEnded = from.session != null && !from.session.isAlive();
        String whole = "'" + from.key + "', one of its keys, was lost: " + reason;
        for (Lease part : parts) {
            if (part != from) {
                part.lost(whole, sessionEnded);
            }
        }
    }

    /**
     * Stops every part's renewal, then releases the keys that may still be held with one
     * {@code DELETE /locks?keys=...}, retrying the keys answered 503 for the release timeout.
     */
    void release() {
        List<String> keys = new ArrayList<>();
        for (Lease part : parts) {
            if (part.stop()) {
                keys.add(part.key);
            }
        }
        long until = System.nanoTime() + broker.releaseTimeout.toNanos();
        Backoff pauses = new Backoff();
        while (!keys.isEmpty()) {
            Map<String, Object> answer = parts.get(0).deleteAt("/locks?keys=" + String.join(",", keys),
                    "'" + String.join("', '", keys) + "'", until);
            List<String> again = new ArrayList<>();
            Object results = answer.get("results");
            for (Object result : results instanceof List ? (List<?>) results : List.of()) {
                @SuppressWarnings("unchecked")
                Map<String, Object> one = result instanceof Map ? (Map<String, Object>) result : Map.of();
                Long status = Json.numberField(one, "status");
                if (status != null && Http.retryable(status.intValue())) {
                    again.add(Json.stringField(one, "key"));
                }
            }
            if (!again.isEmpty() && (System.nanoTime() - until >= 0 || !pauses.sleep(null, until))) {
                LockBroker.warn("could not release " + again + " at " + broker.url
                        + " (the broker answered 503); they end by their ttl, as they are no longer renewed");
                return;
            }
            keys = again;
        }
    }
}
