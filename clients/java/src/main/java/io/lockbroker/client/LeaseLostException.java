package io.lockbroker.client;

/**
 * The lease is no longer held: a renewal answered {@code 404}/{@code 409} (or {@code 401}/{@code 403}),
 * or its end passed without a confirmed renewal. Thrown by {@link Lease#ensureHeld()},
 * {@link Lease#renew()} and {@link LockBroker#withLease}.
 */
public class LeaseLostException extends LockBrokerException {
    private static final long serialVersionUID = 1L;

    /**
     * A lost lease's error.
     *
     * @param message says which lease and why
     */
    public LeaseLostException(String message) {
        super(message, 0, "lease_lost", null);
    }

    /**
     * A lost lease's error, with what the loss caused (the interrupted work's exception, say).
     *
     * @param message says which lease and why
     * @param cause what failed because of the loss; may be null
     */
    public LeaseLostException(String message, Throwable cause) {
        super(message, 0, "lease_lost", cause);
    }
}
