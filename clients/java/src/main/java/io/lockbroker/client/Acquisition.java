package io.lockbroker.client;

import java.io.IOException;
import java.net.http.HttpResponse;
import java.security.SecureRandom;
import java.time.Duration;
import java.util.Base64;
import java.util.LinkedHashMap;
import java.util.Map;
import java.util.concurrent.TimeUnit;

/**
 * The acquire loop of a {@link LockBroker}: one request id for every try, the broker doing the
 * waiting, retries after a {@code 503} or a failed connection while the caller's wait lasts, a
 * grant confirmed by a renewal when it may be nearly over, and the clean-up that releases a
 * grant nobody could be sure of.
 */
final class Acquisition {
    private static final SecureRandom RANDOM = new SecureRandom();

    private final LockBroker broker;
    private final Http http;

    Acquisition(LockBroker broker) {
        this.broker = broker;
        this.http = broker.http;
    }

    /** The acquire loop behind every shortcut: see the class comment of {@link LockRequest}. */
    Lease acquire(LockRequest r) {
        if (broker.isClosed()) {
            throw new IllegalStateException("this LockBroker is closed");
        }
        if (r.session != null) {
            r.session.checkAlive("acquire " + r.quoted() + "");
        }
        String path = r.acquirePath();
        long ttlMs = KeyCalls.millis(r.ttl, "ttl", 1);
        // Past a year, a wait is "for ever" (and nanoTime arithmetic stays clear of overflow).
        long waitMs = Math.min(KeyCalls.millis(r.wait, "wait", 0), TimeUnit.DAYS.toMillis(365));
        long start = System.nanoTime();
        long deadline = start + TimeUnit.MILLISECONDS.toNanos(waitMs);
        String requestId = newRequestId();
        // Whether a request since the last definite "not granted" may have been granted (its
        // answer was a 503 or never came), and the send time of the first such request: a lease
        // granted then ends no earlier than this plus the ttl.
        boolean unsure = false;
        long unsureSince = 0;
        Backoff backoff = new Backoff();
        boolean firstAttempt = true;
        BrokerUnavailableException trouble = null;
        while (true) {
            Long retryAfter = null;
            long sent = System.nanoTime();
            long askWait = Math.min(Math.max(0, TimeUnit.NANOSECONDS.toMillis(deadline - sent)),
                    broker.maxWaitPerRequest.toMillis());
            boolean retried = unsure;
            if (!unsure) {
                unsure = true;
                unsureSince = sent;
            }
            Map<String, Object> body = r.body(ttlMs, askWait, requestId, broker.owner);
            HttpResponse<String> response;
            try {
                response = http.send("POST", path, Json.object(body), null,
                        Duration.ofMillis(askWait).plus(broker.http.requestTimeout));
            } catch (IOException e) {
                trouble = http.unreachable("acquire " + r.quoted() + "", e);
                response = null;
            } catch (InterruptedException e) {
                // The request may still be parked at the broker (JDKs before 16 do not abort it):
                // nothing it says is conclusive before it would have ended by itself.
                cleanUpAfter(r, body, unsureSince, ttlMs,
                        sent + TimeUnit.MILLISECONDS.toNanos(askWait) + broker.http.requestTimeout.toNanos());
                Thread.currentThread().interrupt();
                throw new LockBrokerException("interrupted while acquiring " + r.quoted() + "", e);
            }
            if (response != null) {
                int status = response.statusCode();
                Map<String, Object> answer = Json.parseObject(response.body());
                String code = Json.stringField(answer, "error");
                if (status == 201) {
                    // The grant was made after `sent` (or, on a retry, after the first request
                    // that may have made it): its end is no earlier than that plus the ttl.
                    Lease lease = LeaseGroup.granted(broker, r, answer, retried ? unsureSince : sent, ttlMs);
                    if (lease.needsConfirmation() && !lease.parts().stream().allMatch(p -> p.confirm(deadline))) {
                        // Granted after a long wait or on a retry, so possibly nearly over, and
                        // no renewal confirmed it: not returned; released in the background.
                        lease.parts().forEach(Lease::abandon);
                        trouble = new BrokerUnavailableException("cannot acquire " + r.quoted() + " at " + broker.url
                                + ": the broker granted it but did not confirm it with a renewal", 0, null, null);
                        unsure = false;
                        requestId = newRequestId();
                    } else if (r.session != null) {
                        if (!r.session.adopt(lease)) {
                            // The session ended or was closed meanwhile, and the lease with it.
                            lease.parts().forEach(Lease::releasedWithSession);
                            throw r.session.notAlive("acquire " + r.quoted() + "");
                        }
                        return lease;
                    } else {
                        broker.open.add(lease);
                        lease.parts().forEach(Lease::start);
                        if (broker.isClosed()) {
                            lease.release();
                            throw new IllegalStateException("this LockBroker was closed while acquiring");
                        }
                        return lease;
                    }
                } else if (status == 409 && "locked".equals(code)) {
                    unsure = false;
                    if (System.nanoTime() - deadline < 0 && askWait > 0) {
                        continue; // the wait was split over several requests
                    }
                    Long retryMs = Json.numberField(answer, "retry_after_ms");
                    throw r.locked(answer, retryMs == null ? null : Duration.ofMillis(retryMs));
                } else if (Http.retryable(status)) {
                    trouble = http.unavailable("acquire " + r.quoted() + "", response, answer);
                    retryAfter = Http.retryAfterMs(response);
                } else {
                    // A 4xx refused this request, but an earlier one may have been granted; a 5xx
                    // the broker never sends (a proxy's) leaves even this one's outcome unknown.
                    if (retried || status >= 500) {
                        cleanUpAfter(r, body, unsureSince, ttlMs, System.nanoTime());
                    }
                    if (r.session != null && status == 404 && "no_session".equals(code)) {
                        r.session.ended(Session.answered(response, answer));
                    }
                    throw http.refusal("acquire " + r.quoted() + "", response, answer);
                }
            }
            // Retry with the same request_id (a grant made meanwhile comes back, not a second
            // one), for as long as the caller's wait lasts.
            long left = deadline - System.nanoTime();
            boolean staleConnection = firstAttempt && trouble.status() == 0
                    && trouble.getCause() instanceof IOException
                    && !(trouble.getCause() instanceof java.net.http.HttpTimeoutException);
            firstAttempt = false;
            if (left <= 0 && !staleConnection) {
                if (unsure) {
                    cleanUpAfter(r, r.body(ttlMs, 0, requestId, broker.owner), unsureSince, ttlMs,
                            System.nanoTime());
                }
                throw trouble;
            }
            // A kept-alive connection the broker had closed: try a fresh one at once. Otherwise
            // pause, but not past the end of the wait: the last try comes then, with wait_ms=0.
            if (!staleConnection && !backoff.sleep(retryAfter, deadline)) {
                if (unsure) {
                    cleanUpAfter(r, r.body(ttlMs, 0, requestId, broker.owner), unsureSince, ttlMs,
                            System.nanoTime());
                }
                throw new LockBrokerException("interrupted while acquiring " + r.quoted() + "", new InterruptedException());
            }
        }
    }

    /**
     * After giving up on an acquire whose last requests may have been granted: asks again with
     * the same request_id (and no wait) until any such grant would have ended, and releases what
     * comes back, so that no lease is left that nobody holds the token of. A "locked" answer
     * means none of ours is live only once no request of ours can still be waiting at the
     * broker ({@code conclusiveAfter}); before that it keeps asking.
     */
    private void cleanUpAfter(LockRequest r, Map<String, Object> body, long unsureSince, long ttlMs,
            long conclusiveAfter) {
        if (broker.isClosed()) {
            return;
        }
        Map<String, Object> noWait = new LinkedHashMap<>(body);
        noWait.put("wait_ms", 0L);
        long ttl = TimeUnit.MILLISECONDS.toNanos(ttlMs);
        long until = conclusiveAfter - unsureSince > 0 ? conclusiveAfter + ttl : unsureSince + ttl;
        broker.workers.inBackground(() -> {
            Backoff backoff = new Backoff();
            while (!broker.isClosed() && System.nanoTime() - until < 0) {
                Long retryAfter = null;
                try {
                    HttpResponse<String> response = http.send("POST", r.acquirePath(), Json.object(noWait), null,
                            broker.http.requestTimeout);
                    int status = response.statusCode();
                    if (status == 201) {
                        String token = Json.stringField(Json.parseObject(response.body()), "token");
                        if (token != null) {
                            http.send("DELETE", r.releasePath(), null, token, broker.http.requestTimeout);
                        }
                        return;
                    }
                    boolean conclusive = System.nanoTime() - conclusiveAfter >= 0;
                    if (status == 409 && conclusive || status != 409 && !Http.retryable(status)) {
                        return; // not ours: someone else holds it, or nothing to find (or to ask)
                    }
                    retryAfter = Http.retryAfterMs(response);
                } catch (IOException e) {
                    // still unreachable; try again while a lost grant could still be live
                } catch (InterruptedException e) {
                    return;
                }
                if (!backoff.sleep(retryAfter, until)) {
                    return;
                }
            }
        });
    }

    /** 22 URL-safe characters: 128 random bits, as the broker's request_id allows (1 to 64). */
    static String newRequestId() {
        byte[] bytes = new byte[16];
        RANDOM.nextBytes(bytes);
        return Base64.getUrlEncoder().withoutPadding().encodeToString(bytes);
    }
}
