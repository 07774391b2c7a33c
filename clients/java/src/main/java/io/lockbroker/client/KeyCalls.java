package io.lockbroker.client;

import java.io.IOException;
import java.net.URLEncoder;
import java.net.http.HttpResponse;
import java.nio.charset.StandardCharsets;
import java.time.Duration;
import java.util.ArrayList;
import java.util.List;
import java.util.Map;
import java.util.concurrent.TimeUnit;

/**
 * The calls of a {@link LockBroker} that take no lease: inspecting, listing, watching and
 * following keys, and force-releasing them. Its public methods are {@link LockBroker}'s (this
 * class is not public; {@link LockBroker} is the only one to extend it).
 */
abstract class KeyCalls {
    final Http http;
    /** The longest {@code wait_ms} one request asks for. */
    final Duration maxWaitPerRequest;
    volatile boolean closed;

    KeyCalls(Http http, Duration maxWaitPerRequest) {
        this.http = http;
        this.maxWaitPerRequest = maxWaitPerRequest;
    }

    boolean isClosed() {
        return closed;
    }

    void checkOpen() {
        if (closed) {
            throw new IllegalStateException("this LockBroker is closed");
        }
    }

    /**
     * Who holds the lock {@code key} now ({@code GET /locks/{key}}): a view with its fence,
     * owner, mode and end, or a free view ({@link KeyView#isHeld()} false, fence 0) when nobody
     * does. Never a token. {@code 503}s and failed connections are retried for up to the request
     * timeout.
     *
     * @param key the lock's key
     * @return the key's view now ({@link KeyView#changed()} is false)
     * @throws BrokerUnavailableException when the broker could not be reached or kept answering 503
     * @throws LockBrokerException for any other refusal (auth)
     */
    public KeyView inspect(String key) {
        return inspect("/locks/", key);
    }

    /**
     * {@link LockBroker#inspect(String) inspect} for the semaphore {@code key}: its limit, permits taken
     * and highest fence.
     *
     * @param key the semaphore's key
     * @return the semaphore's view now
     */
    public KeyView inspectSemaphore(String key) {
        return inspect("/semaphores/", key);
    }

    private KeyView inspect(String space, String key) {
        Keys.check(key);
        String what = "inspect '" + key + "'";
        HttpResponse<String> response = call("GET", space + key, what);
        Map<String, Object> answer = Json.parseObject(response.body());
        if (response.statusCode() == 200) {
            return KeyView.of(key, true, answer);
        }
        if (response.statusCode() == 404 && "not_held".equals(Json.stringField(answer, "error"))) {
            return KeyView.of(key, false, answer);
        }
        throw http.refusal(what, response, answer);
    }

    /**
     * One page of the held locks whose keys start with {@code prefix}, in key order
     * ({@code GET /locks?prefix=&limit=&cursor=}). Never a token.
     *
     * @param prefix the start of the keys to list ({@code ""}: every key)
     * @param limit at most this many on the page (1 to 1000)
     * @param cursor {@code null} for the first page, else the previous page's {@link KeyListing#nextCursor()}
     * @return the page
     * @throws BrokerUnavailableException when the broker could not be reached or kept answering 503
     * @throws LockBrokerException for any other refusal (auth)
     */
    public KeyListing listLocks(String prefix, int limit, String cursor) {
        return list("/locks", "locks", prefix, limit, cursor);
    }

    /**
     * Every held lock whose key starts with {@code prefix}, in key order: every page of
     * {@link LockBroker#listLocks(String, int, String) listLocks}.
     *
     * @param prefix the start of the keys to list ({@code ""}: every key)
     * @return the locks' views
     */
    public List<KeyView> listLocks(String prefix) {
        return listAll("/locks", "locks", prefix);
    }

    /**
     * {@link LockBroker#listLocks(String, int, String) listLocks} for semaphores: each view has the
     * {@link KeyView#limit()}, the permits taken ({@link KeyView#holders()}) and the highest fence.
     *
     * @param prefix the start of the keys to list ({@code ""}: every key)
     * @param limit at most this many on the page (1 to 1000)
     * @param cursor {@code null} for the first page, else the previous page's {@link KeyListing#nextCursor()}
     * @return the page
     */
    public KeyListing listSemaphores(String prefix, int limit, String cursor) {
        return list("/semaphores", "semaphores", prefix, limit, cursor);
    }

    /**
     * Every held semaphore whose key starts with {@code prefix}, in key order.
     *
     * @param prefix the start of the keys to list ({@code ""}: every key)
     * @return the semaphores' views
     */
    public List<KeyView> listSemaphores(String prefix) {
        return listAll("/semaphores", "semaphores", prefix);
    }

    private List<KeyView> listAll(String space, String field, String prefix) {
        List<KeyView> all = new ArrayList<>();
        String cursor = null;
        do {
            KeyListing page = list(space, field, prefix, 1000, cursor);
            all.addAll(page.keys());
            cursor = page.nextCursor().orElse(null);
        } while (cursor != null);
        return all;
    }

    private KeyListing list(String space, String field, String prefix, int limit, String cursor) {
        String p = Keys.checkPrefix(prefix);
        if (limit < 1 || limit > 1000) {
            throw new IllegalArgumentException("a listing's limit is 1 to 1000, not " + limit);
        }
        String what = "list " + field + " under '" + p + "'";
        String path = space + "?prefix=" + p + "&limit=" + limit
                + (cursor == null ? "" : "&cursor=" + URLEncoder.encode(cursor, StandardCharsets.UTF_8));
        HttpResponse<String> response = call("GET", path, what);
        Map<String, Object> answer = Json.parseObject(response.body());
        if (response.statusCode() != 200 || !(answer.get(field) instanceof List)) {
            throw http.refusal(what, response, answer);
        }
        List<KeyView> views = new ArrayList<>();
        for (Object entry : (List<?>) answer.get(field)) {
            if (entry instanceof Map) {
                @SuppressWarnings("unchecked")
                Map<String, Object> listed = (Map<String, Object>) entry;
                views.add(KeyView.of(Json.stringField(listed, "key"), true, listed));
            }
        }
        return new KeyListing(views, Json.stringField(answer, "next_cursor"));
    }

    /**
     * Ends every lease on the lock {@code key} without its token ({@code DELETE
     * /locks/{key}?force=true}); their holders learn it at their next renewal. With auth on it
     * needs the {@code admin} permission; with auth off the broker must run with
     * {@code --allow-force-release}, or it answers {@code 403 forbidden}.
     *
     * @param key the lock's key
     * @return true when leases were ended; false when nobody held it (or an earlier try of this
     *     call, whose answer was lost, had ended them)
     * @throws BrokerUnavailableException when the broker could not be reached or kept answering 503
     * @throws LockBrokerException for any other refusal ({@code 403 forbidden})
     */
    public boolean forceRelease(String key) {
        return forceRelease("/locks/", key);
    }

    /**
     * {@link LockBroker#forceRelease(String) forceRelease} for the semaphore {@code key}: ends every permit.
     *
     * @param key the semaphore's key
     * @return true when permits were ended; false when none was held
     */
    public boolean forceReleaseSemaphore(String key) {
        return forceRelease("/semaphores/", key);
    }

    private boolean forceRelease(String space, String key) {
        Keys.check(key);
        String what = "force-release '" + key + "'";
        HttpResponse<String> response = call("DELETE", space + key + "?force=true", what);
        int status = response.statusCode();
        if (status == 204 || status == 200) {
            return true;
        }
        Map<String, Object> answer = Json.parseObject(response.body());
        if (status == 404 && "not_held".equals(Json.stringField(answer, "error"))) {
            return false;
        }
        throw http.refusal(what, response, answer);
    }

    /**
     * One watch of the lock {@code key}: answers at once when its holders differ from
     * {@code seenFence} (0 for "free"), otherwise when they change within {@code wait}, or with
     * the unchanged view ({@link KeyView#changed()} false) when the wait runs out. A {@code 503}
     * or a failed connection is retried (after {@code Retry-After}, or a backoff) while the wait
     * lasts; a watch changes nothing, so a retry is harmless.
     *
     * @param key the lock's key
     * @param seenFence the fence last seen, 0 for free
     * @param wait how long to wait for a change
     * @return the key's view
     * @throws BrokerUnavailableException when the broker could not be reached or kept answering 503
     * @throws LockBrokerException for any other refusal (auth), or a 5xx other than 502, 503, 504
     */
    public KeyView watch(String key, long seenFence, Duration wait) {
        return watch("/locks/", key, seenFence, wait);
    }

    /**
     * {@link LockBroker#watch(String, long, Duration) watch} for the semaphore {@code key} (its fence: the
     * highest permit's).
     *
     * @param key the semaphore's key
     * @param seenFence the highest fence last seen, 0 for free
     * @param wait how long to wait for a change
     * @return the semaphore's view
     */
    public KeyView watchSemaphore(String key, long seenFence, Duration wait) {
        return watch("/semaphores/", key, seenFence, wait);
    }

    /**
     * Follows the lock {@code key}: calls {@code onView} on a thread of its own with the key's
     * view now, then with every change, in order, watching again with each answer's fence (two
     * changes between two watches show as one), until the returned watcher is closed. An
     * unreachable broker is retried for as long as it takes.
     *
     * @param key the lock's key
     * @param onView called with each view, in order, on the watcher's thread
     * @return the watcher: close it to stop
     * @throws BrokerUnavailableException when the first watch found the broker unreachable
     * @throws LockBrokerException when the first watch was refused (auth)
     */
    public KeyWatcher follow(String key, java.util.function.Consumer<KeyView> onView) {
        return follow("/locks/", key, onView);
    }

    /**
     * {@link LockBroker#follow(String, java.util.function.Consumer) follow} for the semaphore {@code key}.
     *
     * @param key the semaphore's key
     * @param onView called with each view, in order, on the watcher's thread
     * @return the watcher: close it to stop
     */
    public KeyWatcher followSemaphore(String key, java.util.function.Consumer<KeyView> onView) {
        return follow("/semaphores/", key, onView);
    }

    private KeyWatcher follow(String space, String key, java.util.function.Consumer<KeyView> onView) {
        if (onView == null) {
            throw new IllegalArgumentException("onView is null");
        }
        // The first watch, on the caller's thread, so that a refusal (auth) fails here.
        KeyView first = watch(space, key, 0, Duration.ZERO);
        return new KeyWatcher(this, space, key, first, onView);
    }

    KeyView watch(String space, String key, long seenFence, Duration wait) {
        checkOpen();
        Keys.check(key);
        if (seenFence < 0) {
            throw new IllegalArgumentException("seenFence must be 0 (free) or a fence, not " + seenFence);
        }
        long waitMs = Math.min(millis(wait, "wait", 0), TimeUnit.DAYS.toMillis(365));
        long deadline = System.nanoTime() + TimeUnit.MILLISECONDS.toNanos(waitMs);
        String base = space + key; // checked by Keys: nothing in it needs escaping
        Http.Retries retries = new Http.Retries(deadline);
        while (true) {
            long askWait = Math.min(Math.max(0, TimeUnit.NANOSECONDS.toMillis(deadline - System.nanoTime())),
                    maxWaitPerRequest.toMillis());
            BrokerUnavailableException trouble;
            Long retryAfter = null;
            try {
                HttpResponse<String> response = http.send("GET", base + "?watch=" + seenFence + "&wait_ms=" + askWait,
                        null, null, Duration.ofMillis(askWait).plus(http.requestTimeout));
                int status = response.statusCode();
                Map<String, Object> answer = Json.parseObject(response.body());
                String code = Json.stringField(answer, "error");
                if (status == 200 || status == 404 && "not_held".equals(code)) {
                    KeyView view = KeyView.of(key, status == 200, answer);
                    if (!view.changed() && askWait > 0 && System.nanoTime() - deadline < 0) {
                        continue; // the wait was split over several requests
                    }
                    return view;
                } else if (Http.retryable(status)) {
                    trouble = http.unavailable("watch '" + key + "'", response, answer);
                    retryAfter = Http.retryAfterMs(response);
                } else {
                    throw http.refusal("watch '" + key + "'", response, answer);
                }
            } catch (IOException e) {
                trouble = http.unreachable("watch '" + key + "'", e);
            } catch (InterruptedException e) {
                Thread.currentThread().interrupt();
                throw new LockBrokerException("interrupted while watching '" + key + "'", e);
            }
            retries.after(trouble, retryAfter, "interrupted while watching '" + key + "'");
        }
    }

    /**
     * One request that may be repeated as it is, without a body: {@link Http#call} on an open client.
     */
    private HttpResponse<String> call(String method, String path, String what) {
        checkOpen();
        return http.call(method, path, what);
    }

    static Duration positive(Duration d, String name) {
        if (d == null || d.isZero() || d.isNegative()) {
            throw new IllegalArgumentException(name + " must be positive, not " + d);
        }
        return d;
    }

    static long millis(Duration d, String name, long min) {
        if (d == null) {
            throw new IllegalArgumentException(name + " is required");
        }
        if (d.isNegative() || d.compareTo(Duration.ofDays(3650)) > 0) {
            throw new IllegalArgumentException(name + " must be between " + min + " ms and ten years, not " + d);
        }
        long ms = d.toMillis();
        if (ms < min) {
            throw new IllegalArgumentException(name + " must be at least " + min + " ms, not " + d);
        }
        return ms;
    }
}
