package io.lockbroker.client;

/**
 * Every error this client raises about the broker. {@link #status()} and {@link #code()} are the
 * broker's HTTP status and error code ({@code "invalid_request"}, {@code "forbidden"},
 * {@code "limit_mismatch"}, ...) when it answered, and {@code 0} and {@code null} when it did not.
 */
public class LockBrokerException extends RuntimeException {
    private static final long serialVersionUID = 1L;

    private final int status;
    private final String code;

    public LockBrokerException(String message) {
        this(message, 0, null, null);
    }

    public LockBrokerException(String message, Throwable cause) {
        this(message, 0, null, cause);
    }

    public LockBrokerException(String message, int status, String code, Throwable cause) {
        super(message, cause);
        this.status = status;
        this.code = code;
    }

    /** The HTTP status the broker answered, or 0 when no answer came. */
    public int status() {
        return status;
    }

    /** The broker's error code ({@code "locked"}, {@code "store_unavailable"}, ...), or null. */
    public String code() {
        return code;
    }
}
