package io.lockbroker.client;

/**
 * The broker could not be reached, or kept answering {@code 503} (store unavailable, shutting
 * down, too many waiters, a store-wide hold), until the caller's wait ran out. Nothing was
 * granted that the caller holds: a grant the client could not confirm is released in the
 * background.
 */
public class BrokerUnavailableException extends LockBrokerException {
    private static final long serialVersionUID = 1L;

    public BrokerUnavailableException(String message, int status, String code, Throwable cause) {
        super(message, status, code, cause);
    }
}
