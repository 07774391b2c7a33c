package io.lockbroker.client;

import java.util.List;
import java.util.concurrent.ExecutorService;
import java.util.concurrent.Executors;
import java.util.concurrent.RejectedExecutionException;
import java.util.concurrent.ScheduledThreadPoolExecutor;
import java.util.concurrent.ThreadFactory;
import java.util.concurrent.atomic.AtomicInteger;
import java.util.function.Consumer;

/** The background threads of a {@link LockBroker}, all daemons, stopped by its {@code close()}. */
final class Workers {
    /** Times renewals and loss checks; its tasks only start requests, never block. */
    final ScheduledThreadPoolExecutor timer;
    /** Runs lost-lease callbacks, so that a slow one holds up no renewal. */
    final ExecutorService callbacks;
    /** Blocking background work: releasing grants the client could not confirm. */
    final ExecutorService background;

    Workers() {
        this.timer = new ScheduledThreadPoolExecutor(1, daemon("lockbroker-renew"));
        this.timer.setRemoveOnCancelPolicy(true);
        this.callbacks = Executors.newSingleThreadExecutor(daemon("lockbroker-lost-callbacks"));
        this.background = Executors.newCachedThreadPool(daemon("lockbroker-cleanup"));
    }

    /** Runs blocking clean-up work on a background thread; nothing once the client is closed. */
    void inBackground(Runnable work) {
        try {
            background.execute(work);
        } catch (RejectedExecutionException e) {
            // closed meanwhile: close() released what it could
        }
    }

    /**
     * Runs the lost callbacks in order on the callback thread, each through {@code run} (which
     * catches what it throws); here, when the client is closed, rather than never.
     */
    void runLostCallbacks(List<Runnable> toRun, Consumer<Runnable> run) {
        for (Runnable callback : toRun) {
            try {
                callbacks.execute(() -> run.accept(callback));
            } catch (RejectedExecutionException e) {
                run.accept(callback);
            }
        }
    }

    void shutdown() {
        timer.shutdownNow();
        callbacks.shutdown();
        background.shutdownNow();
    }

    static ThreadFactory daemon(String name) {
        AtomicInteger n = new AtomicInteger();
        return task -> {
            Thread t = new Thread(task, name + "-" + n.incrementAndGet());
            t.setDaemon(true);
            return t;
        };
    }
}
