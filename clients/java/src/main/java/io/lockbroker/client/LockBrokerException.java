package io.lockbroker.client;

/**
 * Every error this client raises about the broker. {@link #status()} and {@link #code()} are the
 * broker's HTTP status and error code ({@code "invalid_request"}, {@code "forbidden"},
 * {@code "limit_mismatch"}, ...) when it answered, and {@code 0} and {@code null} when it did not.
 */
public class LockBrokerException extends RuntimeException {
    private static final long serialVersionUID = 1L;

    /**
     * The HTTP status of the answer; 0 when none came.
     */
    private final int status;
    /**
     * The broker's error code; null when none.
     */
    private final String code;

    /**
     * An error without an answer from the broker.
     *
     * @param message says what failed
     */
    public LockBrokerException(String message) {
        this(message, 0, null, null);
    }

    /**
     * An error without an answer from the broker, caused by another.
     *
     * @param message says what failed
     * @param cause what caused it
     */
    public LockBrokerException(String message, Throwable cause) {
        this(message, 0, null, cause);
    }

    /**
     * An error, with the broker's answer when one came.
     *
     * @param message says what was asked, of which broker, and what came back
     * @param status the HTTP status; 0 when no answer came
     * @param code the broker's error code; null when none
     * @param cause what caused it; null when nothing else did
     */
    public LockBrokerException(String message, int status, String code, Throwable cause) {
        super(message, cause);
        this.status = status;
        this.code = code;
    }

    /**
     * The HTTP status the broker answered, or 0 when no answer came.
     *
     * @return the status, or 0
     */
    public int status() {
        return status;
    }

    /**
     * The broker's error code ({@code "locked"}, {@code "store_unavailable"}, ...), or null.
     *
     * @return the code, or null
     */
    public String code() {
        return code;
    }
}
