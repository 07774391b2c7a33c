package io.lockbroker.client;

/**
 * The lease is no longer held: a renewal answered {@code 404}/{@code 409}, or its end passed
 * without a confirmed renewal. Thrown by {@link Lease#ensureHeld()} and {@link Lease#renew()}.
 */
public class LeaseLostException extends LockBrokerException {
    private static final long serialVersionUID = 1L;

    public LeaseLostException(String message) {
        super(message, 0, "lease_lost", null);
    }
}
