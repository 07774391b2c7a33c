package io.lockbroker.client;

import java.io.IOException;
import java.net.URI;
import java.net.http.HttpClient;
import java.net.http.HttpRequest;
import java.net.http.HttpResponse;
import java.nio.charset.StandardCharsets;
import java.time.Duration;
import java.util.Map;
import java.util.Optional;
import java.util.concurrent.CompletableFuture;
import java.util.concurrent.ExecutorService;
import java.util.concurrent.Executors;

/**
 * The client's HTTP plumbing: one broker's base URL and bearer token, the JDK's HTTP client on
 * threads of its own, requests with their headers, a bodyless call retried while the broker is
 * unavailable, and the errors an answer (or no answer) makes.
 */
final class Http {
    /** The base URL, without a trailing slash. */
    final String url;
    private final String authToken;
    /** How long an answer may take beyond the wait a request asked for. */
    final Duration requestTimeout;
    private final ExecutorService threads;
    private final HttpClient client;

    Http(String url, String authToken, Duration connectTimeout, Duration requestTimeout) {
        if (url == null || url.isBlank()) {
            throw new IllegalArgumentException("the broker's url is required, e.g. http://127.0.0.1:8080");
        }
        String u = url.strip();
        while (u.endsWith("/")) {
            u = u.substring(0, u.length() - 1);
        }
        URI uri = URI.create(u);
        if (!"http".equals(uri.getScheme()) && !"https".equals(uri.getScheme())) {
            throw new IllegalArgumentException("the broker's url must start with http:// or https://, not: " + u);
        }
        this.url = u;
        this.authToken = authToken;
        this.requestTimeout = requestTimeout;
        this.threads = Executors.newCachedThreadPool(Workers.daemon("lockbroker-http"));
        this.client = HttpClient.newBuilder()
                .version(HttpClient.Version.HTTP_1_1)
                .connectTimeout(connectTimeout)
                .executor(threads)
                .build();
    }

    HttpRequest request(String method, String path, String body, String leaseToken, Duration timeout) {
        HttpRequest.Builder b = HttpRequest.newBuilder(URI.create(url + path))
                .timeout(timeout)
                .header("Accept", "application/json");
        if (body != null) {
            b.header("Content-Type", "application/json");
        }
        if (authToken != null) {
            b.header("Authorization", "Bearer " + authToken);
        }
        if (leaseToken != null) {
            b.header("Lock-Token", leaseToken);
        }
        HttpRequest.BodyPublisher publisher = body == null
                ? HttpRequest.BodyPublishers.noBody()
                : HttpRequest.BodyPublishers.ofString(body, StandardCharsets.UTF_8);
        return b.method(method, publisher).build();
    }

    HttpResponse<String> send(String method, String path, String body, String leaseToken, Duration timeout)
            throws IOException, InterruptedException {
        return client.send(request(method, path, body, leaseToken, timeout),
                HttpResponse.BodyHandlers.ofString(StandardCharsets.UTF_8));
    }

    CompletableFuture<HttpResponse<String>> sendAsync(String method, String path, String body,
            String leaseToken, Duration timeout) {
        return client.sendAsync(request(method, path, body, leaseToken, timeout),
                HttpResponse.BodyHandlers.ofString(StandardCharsets.UTF_8));
    }

    /** {@code Retry-After} in milliseconds, when the broker sent it as whole seconds. */
    static Long retryAfterMs(HttpResponse<?> response) {
        Optional<String> header = response.headers().firstValue("Retry-After");
        if (header.isEmpty()) {
            return null;
        }
        try {
            return Math.max(0, Long.parseLong(header.get().strip())) * 1000;
        } catch (NumberFormatException e) {
            return null;
        }
    }

    /**
     * Whether an answer means "try again": {@code 503} (store unavailable, shutting down, a
     * store-wide hold), {@code 429} (too many waiters), or a proxy's {@code 502}/{@code 504} (no
     * broker behind it just now). Any other 5xx is not the broker's (it answers none other) and
     * is not retried.
     */
    static boolean retryable(int status) {
        return status == 503 || status == 429 || status == 502 || status == 504;
    }

    /** A refusal, or an answer no retry would change: names what was asked, the URL and the answer. */
    LockBrokerException refusal(String what, HttpResponse<String> response, Map<String, Object> answer) {
        return new LockBrokerException("cannot " + what + " at " + url + ": " + answered(response, answer),
                response.statusCode(), Json.stringField(answer, "error"), null);
    }

    /** A {@link #retryable(int)} answer, for when the tries have run out. */
    BrokerUnavailableException unavailable(String what, HttpResponse<String> response, Map<String, Object> answer) {
        return new BrokerUnavailableException("cannot " + what + " at " + url + ": " + answered(response, answer),
                response.statusCode(), Json.stringField(answer, "error"), null);
    }

    /** No answer: the connection failed or the request timed out. */
    BrokerUnavailableException unreachable(String what, IOException e) {
        return new BrokerUnavailableException("cannot " + what + ": cannot reach the broker at " + url + ": " + e,
                0, null, e);
    }

    /** "the broker answered 503 store_unavailable (its message)", or a glimpse of a body that is not the broker's. */
    static String answered(HttpResponse<String> response, Map<String, Object> answer) {
        String code = Json.stringField(answer, "error");
        String message = Json.stringField(answer, "message");
        String text = "the broker answered " + response.statusCode() + (code == null ? "" : " " + code)
                + (message == null ? "" : " (" + message + ")");
        if (code == null && message == null) {
            String body = response.body() == null ? "" : response.body().strip().replaceAll("\\s+", " ");
            if (!body.isEmpty()) {
                text += " (not a lockbroker answer: " + (body.length() > 120 ? body.substring(0, 120) + "..." : body)
                        + ")";
            }
        }
        return text;
    }

    /**
     * One request that may be repeated as it is, without a body: {@link #retryable(int)} answers
     * and failed connections are tried again, for up to the request timeout. Any other answer is
     * returned.
     */
    HttpResponse<String> call(String method, String path, String what) {
        Retries retries = new Retries(System.nanoTime() + requestTimeout.toNanos());
        while (true) {
            BrokerUnavailableException trouble;
            Long retryAfter = null;
            try {
                HttpResponse<String> response = send(method, path, null, null, requestTimeout);
                if (!retryable(response.statusCode())) {
                    return response;
                }
                trouble = unavailable(what, response, Json.parseObject(response.body()));
                retryAfter = retryAfterMs(response);
            } catch (IOException e) {
                trouble = unreachable(what, e);
            } catch (InterruptedException e) {
                Thread.currentThread().interrupt();
                throw new LockBrokerException("interrupted while trying to " + what, e);
            }
            retries.after(trouble, retryAfter, "interrupted while trying to " + what);
        }
    }

    /** The tries of one request that may be repeated as it is, until a deadline. */
    static final class Retries {
        private final Backoff backoff = new Backoff();
        private final long deadline;
        private boolean firstAttempt = true;

        Retries(long deadlineNanos) {
            this.deadline = deadlineNanos;
        }

        /**
         * After a failed try: returns to try again, at once on a kept-alive connection the broker
         * had closed, else after a pause ({@code Retry-After}, or a backoff); throws
         * {@code trouble} once the deadline has passed.
         */
        void after(BrokerUnavailableException trouble, Long retryAfter, String interrupted) {
            boolean staleConnection = firstAttempt && trouble.status() == 0
                    && !(trouble.getCause() instanceof java.net.http.HttpTimeoutException);
            firstAttempt = false;
            if (staleConnection) {
                return;
            }
            if (System.nanoTime() - deadline >= 0) {
                throw trouble;
            }
            if (!backoff.sleep(retryAfter, deadline)) {
                throw new LockBrokerException(interrupted, new InterruptedException());
            }
        }
    }

    /** Lets the HTTP client's threads end once idle. */
    void close() {
        threads.shutdown();
    }
}
