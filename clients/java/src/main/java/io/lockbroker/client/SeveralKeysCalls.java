package io.lockbroker.client;

import java.time.Duration;
import java.util.List;

/**
 * The calls of a {@link LockBroker} that take several keys at once. Its public methods are
 * {@link LockBroker}'s (this class is not public; {@link LockBroker} is the only one to extend it).
 */
abstract class SeveralKeysCalls extends KeyCalls {
    SeveralKeysCalls(Http http, Duration maxWaitPerRequest) {
        super(http, maxWaitPerRequest);
    }

    /**
     * Takes the exclusive locks on every one of {@code keys} at once, or none of them
     * ({@code POST /locks}), waiting up to {@code wait} while someone else holds any (the broker
     * does the waiting, in each key's queue order; two callers asking for the same keys in
     * opposite orders do not deadlock). The one lease returned holds them all with one token:
     * {@link Lease#key()} and {@link Lease#fence()} are the first key's,
     * {@link Lease#fence(String)} each key's. Each key is renewed in the background; if any is
     * lost, the whole lease is lost and the others are released. {@link Lease#release()}
     * releases them all. Retried after a {@code 503} or a failed connection as
     * {@link LockBroker#acquire(String, Duration, Duration)} is, with the same {@code request_id}.
     *
     * <pre>{@code
     * try (Lease both = broker.acquireAll(List.of("account:1", "account:2"), Duration.ofSeconds(30),
     *         Duration.ofSeconds(5))) {
     *     transfer(both.fence("account:1"), both.fence("account:2"));
     * }
     * }</pre>
     *
     * @param keys 1 to 64 distinct keys (each 1 to 200 of {@code A-Z a-z 0-9 . _ - :})
     * @param ttl each key's lease length, asked again by each renewal
     * @param wait how long to wait while someone else holds any of them
     * @return the lease of every key, held and renewed
     * @throws LockedException when not every key could be had within {@code wait}
     *     ({@link LockedException#heldKeys()}: the busy ones); none is held then
     * @throws BrokerUnavailableException when the broker could not be reached or kept answering
     *     503 until {@code wait} ran out
     * @throws LockBrokerException for any other refusal (auth: {@code 401}/{@code 403})
     * @throws IllegalArgumentException when the list is empty, longer than 64, names a key twice
     *     or a key that breaks the key rule, or the ttl is under 1 ms
     */
    public Lease acquireAll(List<String> keys, Duration ttl, Duration wait) {
        LockBroker broker = (LockBroker) this;
        return new LockRequest(broker, keys, null).ttl(ttl).maxWait(wait).acquire();
    }
}
