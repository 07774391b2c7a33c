package io.lockbroker.client;

import java.util.concurrent.TimeUnit;
import java.util.function.Consumer;

/**
 * Follows one key: a thread of its own that watches it again with each answer's fence and hands
 * each changed view to a callback, in order, until {@link #close()}. Made by
 * {@link LockBroker#follow(String, Consumer) follow}.
 */
public final class KeyWatcher implements AutoCloseable {
    private final KeyCalls broker;
    private final String space;
    private final String key;
    private final Consumer<KeyView> onView;
    private final Thread thread;
    private volatile boolean closed;

    KeyWatcher(KeyCalls broker, String space, String key, KeyView first, Consumer<KeyView> onView) {
        this.broker = broker;
        this.space = space;
        this.key = key;
        this.onView = onView;
        this.thread = new Thread(() -> run(first), "lockbroker-watch-" + key);
        this.thread.setDaemon(true);
        this.thread.start();
    }

    private void run(KeyView first) {
        deliver(first);
        long seen = first.fence();
        Backoff backoff = new Backoff();
        while (!closed && !broker.isClosed()) {
            KeyView view;
            try {
                view = broker.watch(space, key, seen, broker.maxWaitPerRequest);
            } catch (BrokerUnavailableException e) {
                // Keep following through an outage; the next answer shows the key as it is then.
                if (!backoff.sleep(null, System.nanoTime() + TimeUnit.SECONDS.toNanos(1))) {
                    return;
                }
                continue;
            } catch (RuntimeException e) {
                if (!closed && !broker.isClosed()) {
                    LockBroker.warn("stopped following '" + key + "': " + e.getMessage());
                }
                return; // closed (interrupted), or refused: nothing a retry would change
            }
            backoff.reset();
            if (view.changed() && !closed) {
                deliver(view);
            }
            seen = view.fence();
        }
    }

    private void deliver(KeyView view) {
        try {
            onView.accept(view);
        } catch (RuntimeException e) {
            LockBroker.warn("a watch callback on '" + key + "' threw: " + e);
        }
    }

    /**
     * The key followed.
     *
     * @return the key
     */
    public String key() {
        return key;
    }

    /**
     * Stops following: no callback starts after this returns (one under way is waited for, up to
     * the request timeout). Idempotent; never throws.
     */
    @Override
    public void close() {
        closed = true;
        if (Thread.currentThread() == thread) {
            return; // closed from its own callback: the loop ends after it
        }
        thread.interrupt();
        try {
            thread.join(broker.http.requestTimeout.toMillis());
        } catch (InterruptedException e) {
            Thread.currentThread().interrupt();
        }
    }

    @Override
    public String toString() {
        return "KeyWatcher[" + key + (closed ? ", closed" : "") + "]";
    }
}
