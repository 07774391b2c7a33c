package io.lockbroker.client;

import java.util.concurrent.Callable;
import java.util.concurrent.CompletionException;

/**
 * Work under a lease, for {@link LockBroker#withLease}: interrupts the work's thread when its lease
 * is lost, but only while the work runs.
 */
final class WorkUnderLease implements Runnable {
    private final Thread worker;
    private boolean running = true;
    private boolean interrupted;

    WorkUnderLease(Thread worker) {
        this.worker = worker;
    }

    @Override
    public synchronized void run() {
        if (running) {
            interrupted = true;
            worker.interrupt();
        }
    }

    /** The work is over: no interrupt from now on, and the one this caused is cleared. */
    synchronized boolean finish() {
        running = false;
        if (interrupted) {
            Thread.interrupted();
        }
        return interrupted;
    }

    /** Runs {@code work} under {@code lease} and releases it: see {@link LockBroker#withLease}. */
    static <T> T run(Lease lease, String key, Callable<T> work) {
        WorkUnderLease guard = new WorkUnderLease(Thread.currentThread());
        T result = null;
        Throwable failure = null;
        boolean lost;
        try {
            lease.onLost(guard); // at once if already lost: the work then starts interrupted
            try {
                result = work.call();
            } catch (Exception | Error e) {
                failure = e;
            }
        } finally {
            lost = guard.finish() | !lease.isHeld();
            lease.release();
        }
        if (failure instanceof Error) {
            throw (Error) failure;
        }
        if (lost) {
            throw new LeaseLostException("the work under '" + key + "' was not done while its lease was held: the lease "
                    + lease.lostReason().map(r -> "was lost: " + r).orElse("was released (the client was closed)"),
                    failure);
        }
        if (failure instanceof RuntimeException) {
            throw (RuntimeException) failure;
        }
        if (failure != null) {
            throw new CompletionException(failure);
        }
        return result;
    }
}
