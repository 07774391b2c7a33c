package io.lockbroker.client;

/**
 * The broker could not be reached, or kept answering {@code 503} (store unavailable, shutting
 * down, too many waiters, a store-wide hold), until the caller's wait ran out. Nothing was
 * granted that the caller holds: a grant the client could not confirm is released in the
 * background.
 */
public class BrokerUnavailableException extends LockBrokerException {
    private static final long serialVersionUID = 1L;

    /**
     * The broker could not be reached, or answered as unavailable.
     *
     * @param message says what was asked, of which broker, and what came back
     * @param status the HTTP status of the last answer; 0 when none came
     * @param code the broker's error code ({@code "store_unavailable"}, ...); null when none
     * @param cause the connection's failure; null when an answer came
     */
    public BrokerUnavailableException(String message, int status, String code, Throwable cause) {
        super(message, status, code, cause);
    }
}
