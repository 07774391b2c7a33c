package io.lockbroker.client;

import java.time.Duration;
import java.util.List;
import java.util.Optional;
import java.util.concurrent.CopyOnWriteArrayList;
import java.util.concurrent.CountDownLatch;
import java.util.concurrent.ExecutorService;
import java.util.concurrent.Executors;
import java.util.concurrent.Future;
import java.util.concurrent.TimeUnit;
import java.util.function.Consumer;

/**
 * An election on one lock key: campaigns in the background (an acquire with a long wait, in a
 * loop) and, once elected, holds the renewed lease until it is lost or {@link #close()}d.
 *
 * <pre>{@code
 * Leadership leadership = new Leadership(broker, "jobs:leader", "node-a", Duration.ofSeconds(10));
 * leadership.onElected(() -> scheduler.start());
 * leadership.onRevoked(() -> scheduler.stop());   // stop before anyone else can lead
 * ...
 * leadership.close();   // releases: a successor is elected at once
 * }</pre>
 *
 * <p>Never two leaders in this object's view: {@link #isLeader()} turns false as soon as the
 * lease is lost, and the {@link #onRevoked(Runnable)} callbacks have all returned before it
 * campaigns again. Callbacks run in order on one thread of this object's own. The token is never
 * shown; {@link #leader()} names the current leader from a watch of the key.
 *
 * <p>An unreachable or unavailable broker is campaigned through. A refusal that no retry would
 * change (a bearer token unknown or revoked, {@code 401}; one without the permission for the key,
 * {@code 403}; a 5xx that is not the broker's) ends the campaign at once: {@link #failure()}
 * then says why, the {@link #onFailure(Consumer)} callbacks run, a warning is logged, and this
 * node does not lead again.
 */
public final class Leadership implements AutoCloseable {
    private final LockBroker broker;
    private final String key;
    private final String name;
    private final Duration ttl;
    private final List<Runnable> onElected = new CopyOnWriteArrayList<>();
    private final List<Runnable> onRevoked = new CopyOnWriteArrayList<>();
    private final List<Consumer<LockBrokerException>> onFailure = new CopyOnWriteArrayList<>();
    /** Why the campaign ended, when a refusal ended it. */
    private volatile LockBrokerException failure;
    private final ExecutorService callbacks;
    private final Thread campaign;
    private final KeyWatcher watcher;
    /** The owner label of the key's holder as last watched; null when free. */
    private volatile String watchedLeader;
    /** The lease while this node leads; null otherwise. Guarded by {@code this}. */
    private Lease lease;
    /** Counted down when the current term ends (lost, or closed). Guarded by {@code this}. */
    private CountDownLatch termEnded;
    private boolean closed;
    /** The thread the callbacks run on: close() from a callback must not wait for itself. */
    private volatile Thread callbackThread;

    /**
     * Starts campaigning for {@code key} as {@code name} (the lease's {@code owner} label, which
     * {@link #leader()} reports), with leases of {@code ttl}, renewed while this node leads.
     *
     * @param broker the client to campaign through
     * @param key the lock whose holder leads
     * @param name this node's name, the lease's {@code owner} label
     * @param ttl the lease's ttl: how long a leader that stops renewing (dies) keeps the lead
     * @throws BrokerUnavailableException when the broker could not be reached to watch the key
     * @throws LockBrokerException when the broker refused to show the key (auth)
     * @throws IllegalArgumentException when an argument is missing or the key breaks the key rule
     */
    public Leadership(LockBroker broker, String key, String name, Duration ttl) {
        if (broker == null || name == null || ttl == null) {
            throw new IllegalArgumentException("broker, name and ttl are required");
        }
        Keys.check(key);
        if (ttl.toMillis() < 1) {
            throw new IllegalArgumentException("ttl must be at least 1 ms, not " + ttl);
        }
        this.broker = broker;
        this.key = key;
        this.name = name;
        this.ttl = ttl;
        this.callbacks = Executors.newSingleThreadExecutor(task -> {
            Thread t = new Thread(task, "lockbroker-leadership-" + key);
            t.setDaemon(true);
            callbackThread = t;
            return t;
        });
        this.watcher = broker.follow(key, view -> watchedLeader = view.isHeld() ? view.owner().orElse("") : null);
        this.campaign = new Thread(this::campaign, "lockbroker-campaign-" + key);
        this.campaign.setDaemon(true);
        this.campaign.start();
    }

    private void campaign() {
        try {
            campaignUntilClosed();
        } finally {
            // Only now: the onRevoked callbacks of the last term were submitted before.
            callbacks.shutdown();
        }
    }

    private void campaignUntilClosed() {
        Backoff backoff = new Backoff();
        while (true) {
            synchronized (this) {
                if (closed) {
                    return;
                }
            }
            Thread.interrupted(); // an interrupt meant for the previous term's wait
            Lease won;
            try {
                won = broker.lock(key).owner(name).ttl(ttl).maxWait(broker.maxWaitPerRequest).acquire();
            } catch (LockedException e) {
                backoff.reset();
                continue; // someone else still leads: wait again
            } catch (BrokerUnavailableException | IllegalStateException e) {
                if (broker.isClosed()) {
                    return;
                }
                backoff.sleep(null, System.nanoTime() + TimeUnit.SECONDS.toNanos(1));
                continue;
            } catch (LockBrokerException e) {
                if (isClosed() || broker.isClosed()) {
                    return; // interrupted by close()
                }
                if (e.status() != 0) {
                    fail(e); // refused (401, 403, ...): asking again would be refused again
                    return;
                }
                LockBroker.warn("campaign for '" + key + "' failed: " + e.getMessage());
                backoff.sleep(null, System.nanoTime() + TimeUnit.SECONDS.toNanos(1));
                continue;
            }
            backoff.reset();
            CountDownLatch ended = new CountDownLatch(1);
            List<Runnable> elected;
            synchronized (this) {
                if (closed) {
                    won.release();
                    return;
                }
                lease = won;
                termEnded = ended;
                // Those registered from now on run from onElected() itself: each runs once.
                elected = List.copyOf(onElected);
            }
            won.onLost(ended::countDown);
            await(runCallbacks(elected));
            try {
                // A release from outside (the LockBroker closed under it) is not a loss and
                // counts nothing down: look at the lease now and then as well.
                while (!ended.await(100, TimeUnit.MILLISECONDS) && won.isHeld()) {
                    continue;
                }
            } catch (InterruptedException e) {
                // close() ends the term: it released the lease and counted down
            }
            synchronized (this) {
                lease = null;
                termEnded = null;
            }
            won.release(); // lost or closed: make sure nothing is renewed any more
            // Every onRevoked callback has returned before this node campaigns again.
            await(runCallbacks(onRevoked));
        }
    }

    /** Ends the campaign for good on a refusal: says so once, then runs the failure callbacks. */
    private void fail(LockBrokerException e) {
        List<Consumer<LockBrokerException>> toRun;
        synchronized (this) {
            failure = e;
            toRun = List.copyOf(onFailure);
        }
        LockBroker.warn("stopped campaigning for '" + key + "' as " + name + ": " + e.getMessage());
        await(callbacks.submit(() -> {
            for (Consumer<LockBrokerException> callback : toRun) {
                runFailureCallback(callback, e);
            }
        }));
    }

    private void runFailureCallback(Consumer<LockBrokerException> callback, LockBrokerException e) {
        try {
            callback.accept(e);
        } catch (RuntimeException thrown) {
            LockBroker.warn("a leadership callback on '" + key + "' threw: " + thrown);
        }
    }

    private Future<?> runCallbacks(List<Runnable> list) {
        return callbacks.submit(() -> {
            for (Runnable callback : list) {
                try {
                    callback.run();
                } catch (RuntimeException e) {
                    LockBroker.warn("a leadership callback on '" + key + "' threw: " + e);
                }
            }
        });
    }

    private static void await(Future<?> future) {
        boolean interrupted = false;
        while (true) {
            try {
                future.get();
                break;
            } catch (InterruptedException e) {
                interrupted = true;
            } catch (java.util.concurrent.ExecutionException e) {
                break;
            }
        }
        if (interrupted) {
            Thread.currentThread().interrupt();
        }
    }

    /**
     * Whether this node leads now: elected, and its lease neither lost nor released.
     *
     * @return true while this node leads
     */
    public boolean isLeader() {
        Lease current;
        synchronized (this) {
            current = lease;
        }
        return current != null && current.isHeld();
    }

    /**
     * The current leader's name (its lease's {@code owner} label; "" if it gave none), this
     * node's own while it leads, otherwise as the last watch of the key saw it; empty when
     * nobody leads.
     *
     * @return the leader's name; empty when nobody leads
     */
    public Optional<String> leader() {
        if (isLeader()) {
            return Optional.of(name);
        }
        return Optional.ofNullable(watchedLeader);
    }

    /**
     * This node's fence while it leads (send it with every write, as with any lease).
     *
     * @return the fence of this node's lease; empty when it does not lead
     */
    public Optional<Long> fence() {
        Lease current;
        synchronized (this) {
            current = lease;
        }
        return current != null && current.isHeld() ? Optional.of(current.fence()) : Optional.empty();
    }

    /**
     * Runs {@code callback} each time this node is elected, on this object's callback thread; if
     * it leads already, once now on that thread as well.
     *
     * @param callback what to run each time this node is elected
     */
    public void onElected(Runnable callback) {
        if (callback == null) {
            throw new IllegalArgumentException("callback is null");
        }
        boolean leading;
        synchronized (this) {
            onElected.add(callback);
            leading = lease != null && !closed;
        }
        if (leading) {
            try {
                callbacks.execute(callback);
            } catch (java.util.concurrent.RejectedExecutionException e) {
                // closed meanwhile: the term is over
            }
        }
    }

    /**
     * Runs {@code callback} once each time this node stops leading (its lease lost, or
     * {@link #close()}/{@link #resign()}), on this object's callback thread, before it could
     * campaign again.
     *
     * @param callback what to run each time this node stops leading
     */
    public void onRevoked(Runnable callback) {
        if (callback == null) {
            throw new IllegalArgumentException("callback is null");
        }
        onRevoked.add(callback);
    }

    /**
     * Why the campaign ended, when a refusal ended it ({@code 401 unauthorized}, {@code 403
     * forbidden}, ...): this node no longer campaigns and will not lead.
     *
     * @return the refusal; empty while campaigning or leading, and after a plain {@link #close()}
     */
    public Optional<LockBrokerException> failure() {
        return Optional.ofNullable(failure);
    }

    /**
     * Runs {@code callback} once, on this object's callback thread, if a refusal ends the
     * campaign (see {@link #failure()}); at once, on the calling thread, if one has already.
     *
     * @param callback called with the refusal
     */
    public void onFailure(Consumer<LockBrokerException> callback) {
        if (callback == null) {
            throw new IllegalArgumentException("callback is null");
        }
        LockBrokerException now;
        synchronized (this) {
            now = failure;
            if (now == null) {
                onFailure.add(callback);
            }
        }
        if (now != null) {
            runFailureCallback(callback, now);
        }
    }

    /**
     * The key campaigned for.
     *
     * @return the key
     */
    public String key() {
        return key;
    }

    /**
     * This node's name (the {@code owner} label of its lease).
     *
     * @return the name
     */
    public String name() {
        return name;
    }

    private synchronized boolean isClosed() {
        return closed;
    }

    /** The same as {@link #close()}: stops leading (releasing the lease) and campaigning. */
    public void resign() {
        close();
    }

    /**
     * Stops campaigning and, when leading, releases the lease so that a successor is elected at
     * once. When it returns, the {@link #onRevoked(Runnable)} callbacks have run (bounded by the
     * client's release and request timeouts). Idempotent; never throws.
     */
    @Override
    public void close() {
        Lease current;
        CountDownLatch ended;
        synchronized (this) {
            if (closed) {
                return;
            }
            closed = true;
            current = lease;
            ended = termEnded;
        }
        if (current != null) {
            current.release();
        }
        if (ended != null) {
            ended.countDown();
        } else {
            campaign.interrupt(); // a campaigning acquire gives up (and cleans up after itself)
        }
        // From a callback, the campaign thread may be waiting for that very callback to return.
        if (Thread.currentThread() != campaign && Thread.currentThread() != callbackThread) {
            try {
                campaign.join(broker.releaseTimeout.plus(broker.http.requestTimeout).toMillis());
            } catch (InterruptedException e) {
                Thread.currentThread().interrupt();
            }
        }
        watcher.close();
    }

    @Override
    public String toString() {
        return "Leadership[" + key + " as " + name + (isLeader() ? ", leading" : "") + (isClosed() ? ", closed" : "") + "]";
    }
}
