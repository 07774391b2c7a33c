package io.lockbroker.client.tests;

import com.sun.net.httpserver.HttpExchange;
import com.sun.net.httpserver.HttpServer;
import java.io.IOException;
import java.io.InputStream;
import java.io.OutputStream;
import java.net.InetAddress;
import java.net.InetSocketAddress;
import java.net.URI;
import java.net.http.HttpClient;
import java.net.http.HttpRequest;
import java.net.http.HttpResponse;
import java.nio.charset.StandardCharsets;
import java.time.Duration;
import java.util.ArrayList;
import java.util.List;
import java.util.concurrent.ConcurrentLinkedQueue;
import java.util.concurrent.ExecutorService;
import java.util.concurrent.Executors;
import java.util.function.Predicate;

/**
 * An HTTP proxy on a loopback port between the client and a broker: it records every request
 * (method, path, body, the answer the client got) and can answer in the broker's place, to
 * count renewals, to make a grant's answer get lost on the way back, and to answer as a broken
 * proxy would (a 500 or a 502 that is not the broker's).
 */
final class RecordingProxy implements AutoCloseable {
    /** One request and what the client got. */
    static final class Call {
        final String method;
        final String path;
        final String body;
        volatile int status;
        /** What the broker answered, when the request reached it (the client may have got a fault instead). */
        volatile String upstreamBody;
        volatile int upstreamStatus;

        Call(String method, String path, String body) {
            this.method = method;
            this.path = path;
            this.body = body;
        }

        boolean isRenew() {
            return "POST".equals(method) && path.contains("/renew");
        }

        boolean isAcquire() {
            return "POST".equals(method) && !path.contains("/renew");
        }

        @Override
        public String toString() {
            return method + " " + path + " " + body + " -> " + status;
        }
    }

    /** What to do with a matching request instead of passing it through. */
    enum Fault {
        /** Answer 503 store_unavailable without asking the broker. */
        ANSWER_503,
        /** Pass it to the broker, then answer the client 503 as if the broker had failed. */
        FORWARD_THEN_503,
        /** Answer 500 without asking the broker, with a body that is not the broker's (a proxy's own error). */
        ANSWER_500,
        /** Pass it to the broker, then answer the client a proxy's 500. */
        FORWARD_THEN_500,
        /** Answer 502 without asking the broker, with an HTML page (a proxy with no broker behind it). */
        ANSWER_502
    }

    private static final class Rule {
        final Predicate<Call> match;
        final Fault fault;
        int times;

        Rule(Predicate<Call> match, Fault fault, int times) {
            this.match = match;
            this.fault = fault;
            this.times = times;
        }
    }

    private final String upstream;
    private final HttpServer server;
    private final ExecutorService threads = Executors.newCachedThreadPool(r -> {
        Thread t = new Thread(r, "proxy");
        t.setDaemon(true);
        return t;
    });
    private final HttpClient http = HttpClient.newBuilder().version(HttpClient.Version.HTTP_1_1).build();
    private final List<Call> calls = new ArrayList<>();
    private final ConcurrentLinkedQueue<Rule> rules = new ConcurrentLinkedQueue<>();

    RecordingProxy(String upstream) throws IOException {
        this.upstream = upstream;
        server = HttpServer.create(new InetSocketAddress(InetAddress.getLoopbackAddress(), 0), 64);
        server.createContext("/", this::handle);
        server.setExecutor(threads);
        server.start();
    }

    String url() {
        return "http://127.0.0.1:" + server.getAddress().getPort();
    }

    /** The next {@code times} requests that match get {@code fault} ({@code Integer.MAX_VALUE}: all of them). */
    void fault(Predicate<Call> match, Fault fault, int times) {
        rules.add(new Rule(match, fault, times));
    }

    void clearFaults() {
        rules.clear();
    }

    synchronized List<Call> calls() {
        return new ArrayList<>(calls);
    }

    synchronized long count(Predicate<Call> match) {
        return calls.stream().filter(match).count();
    }

    /** Waits (on this monitor, woken by each request) until {@code count(match) >= n}. */
    synchronized void awaitCount(Predicate<Call> match, long n, Duration limit) throws InterruptedException {
        long end = System.nanoTime() + limit.toNanos();
        while (count(match) < n) {
            long left = end - System.nanoTime();
            if (left <= 0) {
                throw new AssertionError("the proxy saw " + count(match) + " matching requests, not " + n
                        + ", within " + limit + ": " + calls);
            }
            wait(Math.max(1, left / 1_000_000));
        }
    }

    private Fault faultFor(Call call) {
        for (Rule rule : rules) {
            synchronized (rule) {
                if (rule.times > 0 && rule.match.test(call)) {
                    rule.times--;
                    return rule.fault;
                }
            }
        }
        return null;
    }

    private void handle(HttpExchange exchange) throws IOException {
        try {
            String body;
            try (InputStream in = exchange.getRequestBody()) {
                body = new String(in.readAllBytes(), StandardCharsets.UTF_8);
            }
            String path = exchange.getRequestURI().getRawPath()
                    + (exchange.getRequestURI().getRawQuery() == null ? "" : "?" + exchange.getRequestURI().getRawQuery());
            Call call = new Call(exchange.getRequestMethod(), path, body);
            Fault fault = faultFor(call);
            int status;
            String answer;
            String retryAfter = null;
            String contentType = "application/json";
            if (fault == Fault.ANSWER_503) {
                status = 503;
                answer = "{\"error\":\"store_unavailable\",\"message\":\"proxy fault\"}";
            } else if (fault == Fault.ANSWER_500) {
                status = 500;
                answer = "upstream handler crashed";
                contentType = "text/plain";
            } else if (fault == Fault.ANSWER_502) {
                status = 502;
                answer = "<html><head><title>502 Bad Gateway</title></head>\n<body>no upstream</body></html>";
                contentType = "text/html";
            } else {
                HttpRequest.Builder b = HttpRequest.newBuilder(URI.create(upstream + path))
                        .timeout(Duration.ofSeconds(90))
                        .method(call.method, body.isEmpty() ? HttpRequest.BodyPublishers.noBody()
                                : HttpRequest.BodyPublishers.ofString(body));
                for (String h : new String[] {"Content-Type", "Lock-Token", "Authorization"}) {
                    String v = exchange.getRequestHeaders().getFirst(h);
                    if (v != null) {
                        b.header(h, v);
                    }
                }
                try {
                    HttpResponse<String> r = http.send(b.build(), HttpResponse.BodyHandlers.ofString());
                    call.upstreamStatus = r.statusCode();
                    call.upstreamBody = r.body();
                    status = r.statusCode();
                    answer = r.body();
                    retryAfter = r.headers().firstValue("Retry-After").orElse(null);
                    contentType = r.headers().firstValue("Content-Type").orElse(contentType);
                } catch (IOException e) {
                    status = 502;
                    answer = "{\"error\":\"bad_gateway\",\"message\":\"proxy: " + e.getClass().getSimpleName() + "\"}";
                } catch (InterruptedException e) {
                    Thread.currentThread().interrupt();
                    return;
                }
                if (fault == Fault.FORWARD_THEN_503) {
                    status = 503;
                    answer = "{\"error\":\"store_unavailable\",\"message\":\"proxy fault after forwarding\"}";
                    retryAfter = null;
                } else if (fault == Fault.FORWARD_THEN_500) {
                    status = 500;
                    answer = "upstream handler crashed after forwarding";
                    contentType = "text/plain";
                    retryAfter = null;
                }
            }
            call.status = status;
            synchronized (this) {
                calls.add(call);
                notifyAll();
            }
            byte[] bytes = answer.getBytes(StandardCharsets.UTF_8);
            exchange.getResponseHeaders().set("Content-Type", contentType);
            if (retryAfter != null) {
                exchange.getResponseHeaders().set("Retry-After", retryAfter);
            }
            if (status == 204 || bytes.length == 0) {
                exchange.sendResponseHeaders(status, -1);
            } else {
                exchange.sendResponseHeaders(status, bytes.length);
                try (OutputStream out = exchange.getResponseBody()) {
                    out.write(bytes);
                }
            }
        } finally {
            exchange.close();
        }
    }

    @Override
    public void close() {
        server.stop(0);
        threads.shutdownNow();
    }
}
